"""Vision-language batches and references for the Megatron tests: prompts with images, transformers' log-probs."""

import asyncio
from pathlib import Path
from typing import Any

import torch
import transformers
from PIL import Image

from megarl.data.images import ImageInputs, expand_image_tokens, image_inputs

TOKENIZER_VL = Path(__file__).resolve().parents[2] / "megarl" / "assets" / "tokenizer_vl"
VISION_START, VISION_END, IMAGE_PAD = 4096, 4097, 4098


def random_images(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    g = torch.Generator().manual_seed(seed)
    return [Image.fromarray(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()) for w, h in sizes]


def vision_batch(vocab_size: int = 4096, seed: int = 0) -> dict[str, Any]:
    """Rows with 1, 2, 0 and 1 images (of different sizes) in left-padded prompts, right-padded responses; the
    `multi_modal_inputs` column as the dataset makes it."""
    processor = transformers.AutoImageProcessor.from_pretrained(TOKENIZER_VL)
    g = torch.Generator().manual_seed(seed)
    layouts = [[(56, 56)], [(84, 56), (56, 112)], [], [(112, 84)]]
    prompts, inputs = [], []
    for i, sizes in enumerate(layouts):
        text = torch.randint(9, vocab_size, (5,), generator=g).tolist()
        ids = text[:2]
        for _ in sizes:
            ids += [VISION_START, IMAGE_PAD, VISION_END]
        ids += text[2:]
        row = image_inputs(random_images(sizes, seed + i), processor) if sizes else None
        prompts.append(expand_image_tokens(ids, row.token_counts(2) if row else [], IMAGE_PAD))
        inputs.append({"pixel_values": row.pixel_values, "image_grid_thw": row.grid_thw} if row else None)
    response_lens = [6, 4, 7, 0]
    prompt_len, response_len = max(map(len, prompts)), max(response_lens)
    input_ids = torch.zeros(len(prompts), prompt_len + response_len, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (prompt, r) in enumerate(zip(prompts, response_lens, strict=True)):
        input_ids[i, prompt_len - len(prompt) : prompt_len] = torch.tensor(prompt)
        input_ids[i, prompt_len : prompt_len + r] = torch.randint(9, vocab_size, (r,), generator=g)
        mask[i, prompt_len - len(prompt) : prompt_len + r] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "responses": input_ids[:, prompt_len:],
        "response_mask": mask[:, prompt_len:],
        "multi_modal_inputs": inputs,
    }


@torch.no_grad()
def hf_vision_log_probs(model_dir: Path, batch: dict[str, Any]) -> torch.Tensor:
    """transformers' log-probs `[b, r]` of the response tokens (0 off the mask), all rows in one forward."""
    model = transformers.AutoModelForImageTextToText.from_pretrained(model_dir, attn_implementation="eager").float()
    rows = [row for row in batch["multi_modal_inputs"] if row is not None]
    ids, mask = batch["input_ids"], batch["attention_mask"]
    logits = model(
        input_ids=ids,
        attention_mask=mask,
        pixel_values=torch.cat([row["pixel_values"] for row in rows]),
        image_grid_thw=torch.cat([row["image_grid_thw"] for row in rows]),
        mm_token_type_ids=(ids == IMAGE_PAD).int(),
    ).logits
    r = batch["responses"].shape[1]
    log_probs = logits[:, -r - 1 : -1].log_softmax(-1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    return log_probs * batch["response_mask"]


def image_rows(batch: dict[str, Any]) -> list[ImageInputs | None]:
    return [ImageInputs(r["pixel_values"], r["image_grid_thw"]) if r else None for r in batch["multi_modal_inputs"]]


def rank_vision_updates(
    model_dir: Path, cases: list[tuple[str, Any, bool, Any, bool]], batch: dict[str, Any], algo: object
) -> dict[str, dict[str, torch.Tensor]]:
    """Per case (name, layout, train the tower, optimizer config, distributed optimizer): one PPO step from the HF
    weights on this rank's DP share (packed micro-batches of 2 rows); the updated full HF tensors of this rank's
    stage."""
    from megarl.megatron.engine import MegatronEngine
    from megarl.megatron.inputs import MicroBatching
    from megarl.megatron.losses import PolicyLoss
    from megarl.megatron.model import build_model
    from megarl.megatron.optim import make_trainable
    from megarl.megatron.parallel import build_role_groups
    from megarl.megatron.vision import VisionTraining
    from megarl.megatron.weights import SafetensorsReader, gather_hf_weights, load_hf_weights
    from megarl.models.spec import load_hf_config, model_spec

    out = {}
    batching = MicroBatching(micro_batch_size=2)
    for name, role_layout, train_tower, optim, distributed in cases:
        groups = build_role_groups(role_layout)
        spec = model_spec(load_hf_config(model_dir))
        model = build_model(spec, groups, vision_training=VisionTraining(tower=train_tower))
        load_hf_weights(model, groups, SafetensorsReader(model_dir))
        trainable = make_trainable(model, groups, optim, distributed, total_steps=10)
        engine = MegatronEngine(model, groups, trainable, packing=True)
        rows = torch.arange(len(batch["input_ids"])).tensor_split(role_layout.dp)[groups.dp_rank].tolist()
        share = {key: _rows(value, rows) for key, value in batch.items()}
        share["old_log_probs"] = engine.forward(share, batching)["log_probs"]
        g = torch.Generator().manual_seed(1)
        share["advantages"] = torch.randn(batch["responses"].shape, generator=g)[rows] * share["response_mask"]
        engine.train_step(share, batching, PolicyLoss(algo))
        out[name] = gather_hf_weights(model, groups)
    return out


def _rows(value: Any, rows: list[int]) -> Any:
    return [value[i] for i in rows] if isinstance(value, list) else value[rows]


def vision_prompts() -> tuple[list[list[int]], list[list[str]], list[dict[str, torch.Tensor]]]:
    """Three prompts with 1, 2 and 1 images: (expanded ids, each one's base64 images, each one's image inputs)."""
    import base64
    import io

    processor = transformers.AutoImageProcessor.from_pretrained(TOKENIZER_VL)
    layouts = [[(56, 56)], [(84, 56), (56, 84)], [(112, 56)]]
    ids, encoded, inputs = [], [], []
    for i, sizes in enumerate(layouts):
        pictures = random_images(sizes, seed=10 + i)
        row = image_inputs(pictures, processor)
        prompt = [5 + i, 17] + [VISION_START, IMAGE_PAD, VISION_END] * len(sizes) + [42, 9]
        ids.append(expand_image_tokens(prompt, row.token_counts(2), IMAGE_PAD))
        buffers = [io.BytesIO() for _ in pictures]
        for picture, buffer in zip(pictures, buffers, strict=True):
            picture.save(buffer, format="PNG")
        encoded.append([base64.b64encode(b.getvalue()).decode() for b in buffers])
        inputs.append({"pixel_values": row.pixel_values, "image_grid_thw": row.grid_thw})
    return ids, encoded, inputs


def rank_vision_sync_twice(model_dir: Path, role_layout: Any, url: str) -> dict[str, float]:
    """Sync into the engine at `url` (CUDA-IPC-style tensor handles), compare its log-probs on image prompts with
    the trainer's, take a training step (stale), sync again, compare again."""
    from cases.sync_cases import SGD, Replicas, _syncers, _train_step, _trainer
    from megarl.megatron.inputs import MicroBatching

    spec, groups, model, _, engine = _trainer(model_dir, role_layout, SGD)
    syncer = _syncers(model, groups, Replicas(tensor=[url], broadcast=[]), 2**20)["tensor"]
    prompts = vision_prompts()
    gaps = {}
    for round_ in (1, 2):
        if round_ == 2:
            _train_step(engine, spec.vocab_size, seed=0)
            gaps["stale"] = _vision_gap(engine, url, prompts, MicroBatching(micro_batch_size=3))
        syncer.sync(weight_version=f"v{round_}")
        gaps[str(round_)] = _vision_gap(engine, url, prompts, MicroBatching(micro_batch_size=3))
    syncer.close()
    return gaps


def _vision_gap(engine: Any, url: str, prompts: tuple, batching: Any) -> float:
    """max |engine log-prob − trainer log-prob| over the engine's samples of the image prompts (rank 0 samples)."""
    import torch.distributed as dist

    ids, encoded, inputs = prompts
    box: list = [asyncio.run(_vision_samples(url, ids, encoded)) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    samples = box[0]
    width = max(map(len, ids))
    input_ids = torch.zeros(len(ids), width + 6, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (prompt, (output, _)) in enumerate(zip(ids, samples, strict=True)):
        input_ids[i, width - len(prompt) :] = torch.tensor(prompt + output)
        mask[i, width - len(prompt) :] = 1
    batch = {
        "input_ids": input_ids,
        "attention_mask": mask,
        "responses": input_ids[:, width:],
        "response_mask": mask[:, width:],
        "multi_modal_inputs": inputs,
    }
    trainer = engine.forward(batch, batching)["log_probs"]
    return (trainer - torch.tensor([lp for _, lp in samples])).abs().max().item()


async def _vision_samples(url: str, ids: list[list[int]], encoded: list[list[str]]) -> list[tuple[list[int], list]]:
    from cases.engine_cases import engine_client
    from megarl.engines.client.sampling import SamplingParams
    from megarl.engines.client.sglang_api import collapse_image_tokens

    client = engine_client(url)
    sampling = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True, sampling_seed=3)
    try:
        calls = [
            client.generate(collapse_image_tokens(p, IMAGE_PAD), sampling, return_logprob=True, image_data=images)
            for p, images in zip(ids, encoded, strict=True)
        ]
        results = await asyncio.gather(*calls)
    finally:
        await client.close()
    return [(r[0].output_ids, r[0].output_logprobs) for r in results]
