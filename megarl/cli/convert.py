"""`megarl-convert`: Hugging Face safetensors ⇄ megatron dist checkpoints, and a verifier.

    megarl-convert hf-to-mcore --hf DIR --out DIR [--tp N --pp N --ep N] [--first-stage-layers N --last-stage-layers N]
    megarl-convert mcore-to-hf --mcore DIR --hf-config DIR --out DIR [--max-shard-size 2GB]
    megarl-convert verify --hf DIR --mcore DIR [--atol 0]
    megarl-convert lora-to-peft --ckpt DIR --out DIR [--base DIR] [--alpha A]
    megarl-convert lora-merge --ckpt DIR --base DIR --out DIR [--alpha A] [--max-shard-size 2GB]

A `*ForSequenceClassification` checkpoint (a reward model, num_labels=1) converts with its `score.weight` as the
value head, and `verify` compares its scores at the last token instead of log-probs.

Also `python -m tools.convert_ckpt ...` from a checkout. Exit status 2 on bad input.
"""

import argparse
import sys

from megarl.convert.classifier import ClassifierError
from megarl.convert.stream import ConversionError, ConversionStats

_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str) -> int:
    """'2GB', '500MiB', '1000' → bytes."""
    upper = text.strip().upper()
    for unit in sorted(_UNITS, key=len, reverse=True):
        if upper.endswith(unit):
            number = upper[: -len(unit)].strip()
            try:
                return int(float(number) * _UNITS[unit])
            except ValueError:
                break
    try:
        return int(upper)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--max-shard-size {text!r}: use bytes or a size like 2GB, 500MiB") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="megarl-convert", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    to_mcore = sub.add_parser("hf-to-mcore", help="HF safetensors → megatron torch_dist checkpoint")
    to_mcore.add_argument("--hf", required=True, help="Hugging Face model directory (config.json + safetensors)")
    to_mcore.add_argument("--out", required=True, help="checkpoint directory to write (replaced if it exists)")
    to_mcore.add_argument("--tp", type=int, default=1, help="tensor-parallel size to check and pad the vocabulary for")
    to_mcore.add_argument("--pp", type=int, default=1, help="pipeline-parallel size to check")
    to_mcore.add_argument("--ep", type=int, default=1, help="expert-parallel size to check")
    for end in ("first", "last"):
        to_mcore.add_argument(
            f"--{end}-stage-layers",
            type=int,
            help=f"layers of the {end} pipeline stage (--pp uneven)",
        )
    to_hf = sub.add_parser("mcore-to-hf", help="megatron torch_dist checkpoint → HF safetensors")
    to_hf.add_argument("--mcore", required=True, help="checkpoint directory (e.g. .../global_step_10/actor/model)")
    to_hf.add_argument("--hf-config", required=True, help="HF directory whose config and tokenizer files are copied")
    to_hf.add_argument("--out", required=True, help="HF directory to write (replaced if it exists)")
    to_hf.add_argument("--max-shard-size", type=parse_size, default="2GB", help="largest safetensors file")
    check = sub.add_parser("verify", help="compare a checkpoint with an HF directory: tensors and log-probs (scores)")
    check.add_argument("--hf", required=True)
    check.add_argument("--mcore", required=True)
    check.add_argument("--atol", type=float, default=0.0, help="largest tensor difference accepted")
    check.add_argument(
        "--log-prob-atol", type=float, default=1e-4, help="largest log-prob (a classifier's: score) difference accepted"
    )
    _add_lora_parsers(sub)
    return parser


def _add_lora_parsers(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    ckpt_help = "a LoRA actor's trainer checkpoint (.../global_step_10/actor/model)"
    alpha_help = "LoRA alpha (scale alpha/r); default: actor.lora.alpha of the run's config.yaml"
    to_peft = sub.add_parser("lora-to-peft", help="a LoRA actor's checkpoint → a PEFT adapter folder")
    to_peft.add_argument("--ckpt", required=True, help=ckpt_help)
    to_peft.add_argument("--out", required=True, help="adapter folder to write (replaced if it exists)")
    to_peft.add_argument("--base", help="HF base model directory: checked against, recorded in adapter_config.json")
    to_peft.add_argument("--alpha", type=float, help=alpha_help)
    merge = sub.add_parser("lora-merge", help="base HF model + LoRA adapter → merged HF safetensors")
    merge.add_argument("--ckpt", required=True, help=f"{ckpt_help}, or a PEFT adapter folder")
    merge.add_argument("--base", required=True, help="HF base model directory (config, tokenizer and weights)")
    merge.add_argument("--out", required=True, help="HF directory to write (replaced if it exists)")
    merge.add_argument("--alpha", type=float, help=f"{alpha_help} or the PEFT folder's lora_alpha")
    merge.add_argument("--max-shard-size", type=parse_size, default="2GB", help="largest safetensors file")


def _report(stats: ConversionStats) -> None:
    print(
        f"wrote {stats.num_tensors} tensors, {stats.num_bytes / 1e6:.1f} MB in {stats.seconds:.2f} s "
        f"({stats.gb_per_s:.3f} GB/s); peak RSS growth {stats.peak_rss_bytes / 1e6:.1f} MB "
        f"= {stats.peak_rss_bytes / max(stats.num_bytes, 1):.3f} × the weights"
    )


def _lora(args: argparse.Namespace) -> int:
    from megarl.convert.lora import lora_to_peft, merge_lora

    if args.command == "lora-merge":
        _report(merge_lora(args.ckpt, args.base, args.out, alpha=args.alpha, max_shard_bytes=args.max_shard_size))
        return 0
    config = lora_to_peft(args.ckpt, args.out, base_dir=args.base, alpha=args.alpha)
    modules = ", ".join(config["target_modules"])
    print(f"wrote {args.out}: r={config['r']}, lora_alpha={config['lora_alpha']}, target_modules {modules}")
    return 0


def run(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.command == "hf-to-mcore":
        from megarl.convert.stream import Stages, hf_to_mcore

        stages = Stages(args.pp, args.first_stage_layers, args.last_stage_layers)
        _report(hf_to_mcore(args.hf, args.out, tp=args.tp, stages=stages, ep=args.ep))
        return 0
    if args.command == "mcore-to-hf":
        from megarl.convert.stream import mcore_to_hf

        _report(mcore_to_hf(args.mcore, args.hf_config, args.out, max_shard_bytes=args.max_shard_size))
        return 0
    if args.command in ("lora-to-peft", "lora-merge"):
        return _lora(args)
    from megarl.convert.verify import verify

    report = verify(args.hf, args.mcore, atol=args.atol)
    print(f"tensors: {report.num_tensors} compared, {len(report.mismatched)} differ")
    for line in report.mismatched:
        print(f"  {line}")
    print(f"{report.outputs}: max |Δ| {report.max_output_diff:.3g} (accepted {args.log_prob_atol:g})")
    ok = not report.mismatched and report.max_output_diff <= args.log_prob_atol
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


def main() -> None:
    try:
        sys.exit(run(sys.argv[1:]))
    except (ConversionError, ClassifierError, FileNotFoundError, KeyError) as err:
        print(f"megarl-convert: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
