"""`megarl-preprocess DATASET --input FILE --output FILE`: raw data → parquet rows for RLDataset or SFTDataset.

megarl-preprocess gsm8k --input data/gsm8k/train.jsonl --output data/processed/gsm8k/train.parquet
megarl-preprocess gsm8k --input data/gsm8k/test.jsonl --output data/processed/gsm8k_tools/test.parquet --with-tools
megarl-preprocess arith --output data/processed/arith/train.parquet --num-rows 2048 --seed 0
megarl-preprocess largest --output data/processed/largest/test.parquet --num-rows 128 --seed 1 --split test
megarl-preprocess shapes --output data/processed/shapes/train.parquet --num-rows 2048 --seed 0 [--num-images 2]
megarl-preprocess shapes-sft --output data/processed/shapes1/sft.parquet --num-shapes 1 --answer-pool palette
megarl-preprocess sft --input chats.jsonl --output data/processed/chats/train.parquet
megarl-preprocess largest-sft --output data/processed/largest/sft.parquet --num-rows 3200 --seed 0

`sft` and `largest-sft` write chat rows for SFTDataset (`trainer.mode=sft`, megarl/data/sft.py): each JSONL line of
`sft` is {"messages": [...], "tools": [...]} (tools optional); `largest-sft` writes the CPU demo's format warm-up
targets in order (100 steps of 32 conversations need 3200 rows); `shapes-sft` the CPU image demo's (images included).
"""

import argparse
import sys
from pathlib import Path

from megarl.data import arith, gsm8k, largest, sft_jsonl, shapes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="megarl-preprocess", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="dataset", required=True)
    g = sub.add_parser("gsm8k", help="GSM8K jsonl (question, answer ending in '#### N') → parquet")
    g.add_argument("--input", type=Path, required=True, help="a GSM8K .jsonl file")
    g.add_argument("--output", type=Path, required=True, help="the .parquet file to write")
    g.add_argument("--split", default=None, help="split name stored in extra_info (default: from the file name)")
    g.add_argument("--with-tools", action="store_true", help="add a system prompt and the answer-check tool")
    synthetic = {
        "arith": "synthetic single-digit addition → parquet",
        "largest": "synthetic 'largest of five numbers' (the CPU demo's task; test lists held out) → parquet",
        "shapes": "synthetic images: 'which colour is the largest shape?' (vision-language; test scenes held out)",
    }
    for name, help_text in synthetic.items():
        a = sub.add_parser(name, help=help_text)
        a.add_argument("--output", type=Path, required=True, help="the .parquet file to write")
        a.add_argument("--num-rows", type=int, default=2048, help="rows to draw")
        a.add_argument("--seed", type=int, default=0, help="seed of the draw")
        a.add_argument("--split", default="train", help="split name stored in extra_info ('test' = the held-out lists)")
        if name == "shapes":
            _shape_args(a)
    c = sub.add_parser("sft", help="chat conversations jsonl ({messages, tools}) → SFT parquet")
    c.add_argument("--input", type=Path, required=True, help="a .jsonl file, one conversation a line")
    c.add_argument("--output", type=Path, required=True, help="the .parquet file to write")
    w = sub.add_parser("largest-sft", help="the CPU demo's format warm-up targets as SFT chat rows, in order → parquet")
    w.add_argument("--output", type=Path, required=True, help="the .parquet file to write")
    w.add_argument("--num-rows", type=int, default=3200, help="conversations (steps × batch size of the warm-up)")
    w.add_argument("--seed", type=int, default=0, help="seed of the draw")
    v = sub.add_parser("shapes-sft", help="the CPU image demo's format warm-up as SFT chat rows with images → parquet")
    v.add_argument("--output", type=Path, required=True, help="the .parquet file to write")
    v.add_argument("--num-rows", type=int, default=1600, help="conversations (steps × batch size of the warm-up)")
    v.add_argument("--seed", type=int, default=0, help="seed of the draw")
    v.add_argument(
        "--answer-pool", default="scene", choices=shapes.ANSWER_POOLS, help="draw the answer among the scene's colours"
    )
    _shape_args(v)
    return parser.parse_args(argv)


def _shape_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--num-images", type=int, default=1, choices=(1, 2), help="images per prompt")
    parser.add_argument("--num-shapes", type=int, default=None, choices=(1, 2, 3, 4), help="shapes (default: 2-4)")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        print(write(args))
    except (OSError, ValueError) as err:
        print(f"megarl-preprocess: {err}", file=sys.stderr)
        sys.exit(2)


def write(args: argparse.Namespace) -> str:
    """Write the parquet file of `args.dataset`; says what it wrote."""
    if args.dataset in ("arith", "largest"):
        module = arith if args.dataset == "arith" else largest
        count = module.write_parquet(args.output, args.num_rows, args.seed, args.split)
        return f"wrote {count} rows ({args.split}) to {args.output}"
    if args.dataset == "shapes":
        count = shapes.write_parquet(
            args.output, args.num_rows, args.seed, args.split, args.num_images, args.num_shapes
        )
        return f"wrote {count} rows ({args.split}, {args.num_images} image(s) each) to {args.output}"
    if args.dataset == "shapes-sft":
        count = shapes.write_sft_parquet(
            args.output, args.num_rows, args.seed, args.num_images, args.num_shapes, args.answer_pool
        )
        return f"wrote {count} conversations ({args.num_images} image(s) each) to {args.output}"
    if args.dataset == "largest-sft":
        count = largest.write_sft_parquet(args.output, args.num_rows, args.seed)
        return f"wrote {count} conversations to {args.output}"
    if args.dataset == "sft":
        return f"wrote {sft_jsonl.preprocess_jsonl(args.input, args.output)} conversations to {args.output}"
    split = args.split or ("test" if "test" in args.input.stem else "train")
    count = gsm8k.preprocess(args.input, args.output, split, args.with_tools)
    return f"wrote {count} rows ({split}{', with tools' if args.with_tools else ''}) to {args.output}"


if __name__ == "__main__":
    main()
