"""The HTTP routes, one router per endpoint group; `gateway/app.py` only wires them."""
