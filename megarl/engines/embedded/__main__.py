"""`python -m megarl.engines.embedded --model-path DIR [--port N]`: serve a model over SGLang's HTTP protocol.

Flag names follow `python -m sglang.launch_server` where the two overlap. The port opens once the
model is loaded and warmed up, so `/health_generate` answering 200 means ready.
"""

import argparse
import logging

import torch
from aiohttp import web

from megarl.engines.client.auth import EngineKeys
from megarl.engines.embedded.classify import ClassifierArgs
from megarl.engines.embedded.classify import serve as serve_classifier
from megarl.engines.embedded.engine import DTYPES, EmbeddedEngine, EngineArgs
from megarl.engines.embedded.server import EngineServer
from megarl.engines.embedded.weights import freeze_startup_objects


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m megarl.engines.embedded", description=__doc__)
    p.add_argument("--model-path", required=True, help="HF model directory")
    p.add_argument(
        "--tokenizer-path",
        default=None,
        help="tokenizer of /classify text inputs; a vision-language model's image processor is looked for here "
        "after the model's directory",
    )
    p.add_argument(
        "--is-embedding", action="store_true", help="serve a *ForSequenceClassification model through /classify"
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto", choices=list(DTYPES))
    p.add_argument("--load-format", default="auto", choices=["auto", "dummy"])
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=64)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--enable-weights-cpu-backup", action="store_true")
    p.add_argument("--prefix-cache-tokens", type=int, default=32768, help="0 disables the prefix cache")
    p.add_argument(
        "--enable-deterministic-inference",
        action="store_true",
        help="batch-invariant: decode each sequence alone, no prefix cache (SGLang's flag of the same name)",
    )
    p.add_argument(
        "--enable-return-routed-experts", action="store_true", help="answer return_routed_experts (MoE models)"
    )
    p.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (/load_lora_adapter_from_tensors)")
    p.add_argument(
        "--max-lora-rank", type=int, default=None, help="the highest adapter rank taken (with --enable-lora)"
    )
    p.add_argument(
        "--lora-target-modules",
        nargs="*",
        default=None,
        help="projections adapters may target, or all (with --enable-lora)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="bearer key of /generate and the reads; of all but /health* and /ready* without --admin-api-key",
    )
    p.add_argument("--admin-api-key", default=None, help="bearer key of the control endpoints (weights, memory, ...)")
    p.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads on CPU")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    keys = EngineKeys(api=args.api_key, admin=args.admin_api_key)
    if args.is_embedding:
        serve_classifier(classifier_args(args), keys, args.host, args.port)
        return
    engine = EmbeddedEngine(
        EngineArgs(
            model_path=args.model_path,
            tokenizer_path=args.tokenizer_path,
            device=args.device,
            dtype=args.dtype,
            load_format=args.load_format,
            context_length=args.context_length,
            max_running_requests=args.max_running_requests,
            random_seed=args.random_seed,
            enable_weights_cpu_backup=args.enable_weights_cpu_backup,
            prefix_cache_tokens=args.prefix_cache_tokens,
            enable_deterministic_inference=args.enable_deterministic_inference,
            enable_return_routed_experts=args.enable_return_routed_experts,
            enable_lora=args.enable_lora,
            max_lora_rank=args.max_lora_rank,
            lora_target_modules=args.lora_target_modules,
        )
    )
    frozen = freeze_startup_objects()
    logging.getLogger(__name__).info(
        "embedded engine serving %s on %s:%d (%d start-up objects frozen out of gc)",
        args.model_path,
        args.host,
        args.port,
        frozen,
    )
    try:
        server = EngineServer(engine, keys)
        web.run_app(server.app(), host=args.host, port=args.port, print=None)
    finally:
        engine.shutdown()


def classifier_args(args: argparse.Namespace) -> ClassifierArgs:
    """The flags classification mode (`--is-embedding`) reads; the generation-only ones are ignored."""
    return ClassifierArgs(
        model_path=args.model_path,
        tokenizer_path=args.tokenizer_path,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
    )


if __name__ == "__main__":
    main()
