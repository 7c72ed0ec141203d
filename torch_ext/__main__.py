"""python -m torch_ext {demo,doctor}"""
import argparse
import sys


def main(argv=None) -> int:
    from torch_ext.demo import PARTS  # names and descriptions only: no part is imported

    parser = argparse.ArgumentParser(prog="python -m torch_ext")
    sub = parser.add_subparsers(dest="command", required=True)
    parts = "\n".join(f"  {name:<9} {description}" for name, (_, description) in PARTS.items())
    demo = sub.add_parser(
        "demo", help="what torch_ext adds, each part a short before/after (about a minute on a CPU)",
        description="Show what torch_ext adds to this torch, each part a short before/after.",
        epilog=f"parts (all by default, in this order):\n{parts}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    demo.add_argument("--part", action="append", choices=list(PARTS), metavar="NAME",
                      help="run only this part (repeatable)")
    sub.add_parser("doctor", help="versions, CUDA, cache dir: what to paste into a bug report",
                   description="Print torch_ext's environment: what to paste into a bug report.")
    args = parser.parse_args(argv)
    if args.command == "demo":
        from torch_ext.demo import main as demo_main

        return demo_main(args.part)
    if args.command == "doctor":
        from torch_ext.doctor import main as doctor_main

        return doctor_main()
    return 2


if __name__ == "__main__":
    sys.exit(main())
