"""What SQLite's synchronous=FULL (63, item 6) costs one group commit of answer records beside NORMAL, in one run:
the wall time of `Store.record_responses` per commit (the WAL fsync FULL adds is waiting, not CPU, so bench_record.py's
CPU numbers do not show it), by batch size, the two modes interleaved commit by commit on two databases in one folder.

    python benchmarks/gateway/bench_sync_mode.py [--commits 500]

The fsync's cost is the disk's: numbers hold for the machine they were taken on only.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sqlalchemy import event

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.served_answers import ServedAnswer  # noqa: E402
from gateway.records.store import Store  # noqa: E402

SERVED = ServedAnswer("v1", "free_form", 0.5, "token")


def store_in(path: Path, mode: str) -> Store:
    store = Store(str(path))
    store.engine.dispose()  # the pool's connections were opened under the default pragmas

    @event.listens_for(store.engine, "connect")
    def _mode(dbapi_connection, _record):  # runs after calm_core/db.py's own pragmas
        dbapi_connection.execute(f"PRAGMA synchronous={mode}")

    return store


def commit_ms(store: Store, batch: int, tag: str) -> float:
    began = time.perf_counter()
    store.record_responses([(f"chatcmpl-{tag}-{j:024d}", "default", 0.5, SERVED) for j in range(batch)])
    return (time.perf_counter() - began) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=500)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(dir=REPO / ".calm" if (REPO / ".calm").is_dir() else None) as tmp:
        stores = {mode: store_in(Path(tmp) / f"{mode}.sqlite3", mode) for mode in ("NORMAL", "FULL")}
        for mode, store in stores.items():
            with store.engine.connect() as c:
                assert c.exec_driver_sql("PRAGMA synchronous").scalar() == {"NORMAL": 1, "FULL": 2}[mode]
            for i in range(50):
                commit_ms(store, 8, f"warm{i}")
        print(f"{args.commits} commits per row, the modes interleaved; wall ms per commit\n")
        print("| answers per commit | NORMAL p50 | FULL p50 | FULL / NORMAL (p50) | NORMAL p90 | FULL p90 |\n"
              "|---:|---:|---:|---:|---:|---:|")
        for batch in (1, 8, 32):
            times = {mode: [] for mode in stores}
            for i in range(args.commits):
                for mode, store in stores.items():
                    times[mode].append(commit_ms(store, batch, f"b{batch}-{i}"))
            p50 = {m: statistics.median(t) for m, t in times.items()}
            p90 = {m: statistics.quantiles(t, n=10)[-1] for m, t in times.items()}
            print(f"| {batch} | {p50['NORMAL']:.3f} | {p50['FULL']:.3f} | {p50['FULL'] / p50['NORMAL']:.2f}x "
                  f"| {p90['NORMAL']:.3f} | {p90['FULL']:.3f} |")
        for store in stores.values():
            store.close()


if __name__ == "__main__":
    main()
