"""python -m torch_ext demo"""
import argparse
import sys


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m torch_ext")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="compile a model whose HOP bodies return dataclasses, without and with install()")
    args = parser.parse_args()
    if args.command == "demo":
        from torch_ext.demo import main as demo

        return demo()
    return 2


if __name__ == "__main__":
    sys.exit(main())
