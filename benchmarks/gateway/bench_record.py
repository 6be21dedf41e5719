"""CPU of one group commit of answer records (gateway/records/store.py `Store.record_responses`) on SQLite, alone in one
process, by batch size: what the gateway's writer thread spends per commit and per answer, beside the same rows
written with the bare sqlite3 module (the floor).

    python benchmarks/gateway/bench_record.py [--commits 1000]
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from calm_core.served_answers import ServedAnswer  # noqa: E402
from gateway.records.store import Store  # noqa: E402

SERVED = ServedAnswer("v1", "free_form", 0.5, "token")


def store_us(store: Store, batch: int, commits: int, tag: str) -> float:
    began = time.process_time()
    for i in range(commits):
        store.record_responses([(f"chatcmpl-{tag}{i}-{j:024d}", "default", 0.5, SERVED) for j in range(batch)])
    return (time.process_time() - began) / commits * 1e6


def bare_us(path: Path, batch: int, commits: int, tag: str) -> float:
    """The responses rows alone through sqlite3, in the gateway's transaction mode (WAL, synchronous FULL)."""
    con = sqlite3.connect(path, isolation_level=None)
    con.execute("PRAGMA synchronous=FULL")
    sql = "INSERT INTO responses (id, domain, confidence, created_at) VALUES (?, ?, ?, ?) ON CONFLICT (id) DO NOTHING"
    began = time.process_time()
    for i in range(commits):
        con.execute("BEGIN IMMEDIATE")
        con.executemany(sql, [(f"bare-{tag}{i}-{j:024d}", "default", 0.5, 1.0) for j in range(batch)])
        con.execute("COMMIT")
    con.close()
    return (time.process_time() - began) / commits * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--commits", type=int, default=1000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gateway.sqlite3"
        store = Store(str(path))
        store_us(store, 8, 100, "warm")
        print("| answers per commit | Store.record_responses µs per commit | per answer | bare sqlite3 (responses only) "
              "µs per commit |\n|---:|---:|---:|---:|")
        for batch in (1, 8, 32):
            us = store_us(store, batch, args.commits, f"b{batch}")
            bare = bare_us(path, batch, args.commits, f"b{batch}")
            print(f"| {batch} | {us:.0f} | {us / batch:.0f} | {bare:.0f} |")
        store.close()


if __name__ == "__main__":
    main()
