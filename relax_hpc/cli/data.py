"""``relax-hpc data list`` and ``relax-hpc data make NAME [--out FOLDER]``: the data sets of the shipped recipes."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="data_command", metavar="{list,make}", required=True, parser_class=type(p))
    sub.add_parser("list", help="the data sets and how each is made")
    make = sub.add_parser("make", help="write a data set (generated here, or downloaded from the hub)")
    make.add_argument("name", help="the data set (relax-hpc data list)")
    make.add_argument("--out", default=None, help="folder to write into (default: recipes/data/NAME)")
    make.add_argument("--rows", type=int, default=None, help="at most this many rows (default: all; 512 generated)")
    make.add_argument("--seed", type=int, default=0, help="seed of a generated set")


def run(args: argparse.Namespace) -> int:
    from relax_hpc.data.make import DATASETS, make
    from relax_hpc.errors import UserError

    if args.data_command == "list":
        for d in DATASETS.values():
            how = "supplied by you" if d.maker is None else "generated" if d.maker == "synthetic" else d.maker
            print(f"{d.name:<12} {how:<44} {d.what}")
        return 0
    if args.rows is not None and args.rows < 1:
        raise UserError("--rows must be at least 1")
    out = Path(args.out) if args.out else Path("recipes") / "data" / args.name
    print(make(args.name, out, rows=args.rows, seed=args.seed))
    return 0
