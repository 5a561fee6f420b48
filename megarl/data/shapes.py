"""A synthetic vision task: name the colour of the largest shape in an image (or across two images).

Each image (56 to 112 pixels a side) is split into 2×2 cells; 2 to 4 filled shapes (or `num_shapes`; a lone shape
has its whole image as its cell: circle, square, triangle), each in a cell of its own and each of another colour of
the palette (megarl.rewards.shapes.COLOURS), are drawn on a white background without anti-aliasing, so a shape's
pixels are exactly its colour. The largest shape's area is at least `MARGIN` times any other's, so its colour also
has the most pixels. "Which colour is the largest shape? Answer with one word." → "blue". With `num_images=2` the
shapes are spread over two images and the question asks across both.

Rows follow the GSM8K row format (megarl.data.gsm8k) with data_source "megarl/shapes" (reward:
megarl.rewards.shapes), a prompt whose user content is a list of parts (one `{"type": "image"}` per image, then
the text) and an `images` column of PNG bytes, one per image part. Train and test are disjoint: a scene belongs to
the test split iff `is_test(scene)`.

`write_sft_parquet` writes the CPU image demo's format warm-up (`+experiment=sft_shapes`): SFT chat rows whose answer
is a colour chosen at random among the scene's colours (`answer_pool="scene"`, like megarl.data.largest's warm-up) or
of the whole palette (`"palette"`: with one shape a scene's only colour is the answer, so a scene pool would teach
it), then end-of-turn. They teach the format (one colour word, then stop) and not which colour is right.
"""

import io
import math
import random
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw

from megarl.data.arith import write_rows
from megarl.rewards.shapes import COLOURS

DATA_SOURCE = "megarl/shapes"
RGB = dict(
    zip(
        COLOURS,
        [
            (220, 30, 30),
            (30, 160, 50),
            (40, 70, 230),
            (240, 210, 20),
            (140, 50, 180),
            (250, 130, 10),
            (20, 200, 210),
            (250, 130, 190),
        ],
        strict=True,
    )
)
"""The colour of each palette name."""
BACKGROUND = (255, 255, 255)
SIDES = (56, 84, 112)
"""Image widths and heights in pixels (multiples of 28: the image processor does not resize them)."""
FILL = {"circle": math.pi / 4, "square": 1.0, "triangle": 0.5}
"""The share of its bounding square a shape fills."""
MARGIN = 1.5
"""The largest shape's area over any other's, at least."""


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str
    colour: str
    image: int
    """Which image of the prompt it is drawn in."""
    box: tuple[int, int, int]
    """Left, top and side of its bounding square, in pixels."""

    @property
    def area(self) -> float:
        return FILL[self.kind] * self.box[2] ** 2


@dataclass(frozen=True, slots=True)
class Scene:
    sizes: tuple[tuple[int, int], ...]
    """(width, height) of each image."""
    shapes: tuple[Shape, ...]

    @property
    def answer(self) -> str:
        """The colour of the largest shape."""
        return max(self.shapes, key=lambda shape: shape.area).colour


def draw_scene(rng: random.Random, num_images: int, num_shapes: int | None = None) -> Scene:
    """Images of random sizes and `num_shapes` shapes among them (None: 2-4 at random), drawn again until the
    largest stands out by `MARGIN`."""
    sizes = tuple((rng.choice(SIDES), rng.choice(SIDES)) for _ in range(num_images))
    while True:
        shapes = _draw_shapes(rng, sizes, num_shapes)
        areas = sorted(shape.area for shape in shapes)
        if len(areas) == 1 or areas[-1] >= MARGIN * areas[-2]:
            return Scene(sizes, shapes)


def _draw_shapes(rng: random.Random, sizes: tuple[tuple[int, int], ...], num_shapes: int | None) -> tuple[Shape, ...]:
    grid = 1 if num_shapes == 1 else 2  # a lone shape's cell is its whole image
    cells = [(image, column, row) for image in range(len(sizes)) for column in range(grid) for row in range(grid)]
    placed = rng.sample(cells, num_shapes or rng.randint(2, 4))
    colours = rng.sample(COLOURS, len(placed))
    return tuple(_shape(rng, sizes[c[0]], c, colour, grid) for c, colour in zip(placed, colours, strict=True))


def _shape(rng: random.Random, size: tuple[int, int], cell: tuple[int, int, int], colour: str, grid: int) -> Shape:
    """A shape of random kind and side inside `cell` (image, column, row of a `grid`×`grid` split), a pixel clear of
    the cell's edges."""
    cell_width, cell_height = size[0] // grid, size[1] // grid
    side = rng.randint(min(cell_width, cell_height) * 3 // 10, min(cell_width, cell_height) - 2)
    left = cell[1] * cell_width + rng.randint(1, cell_width - side - 1)
    top = cell[2] * cell_height + rng.randint(1, cell_height - side - 1)
    return Shape(rng.choice(list(FILL)), colour, cell[0], (left, top, side))


def render(scene: Scene, image: int) -> bytes:
    """The PNG bytes of image `image` of `scene`."""
    canvas = Image.new("RGB", scene.sizes[image], BACKGROUND)
    draw = ImageDraw.Draw(canvas)
    for shape in scene.shapes:
        if shape.image == image:
            _draw(draw, shape)
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return buffer.getvalue()


def _draw(draw: ImageDraw.ImageDraw, shape: Shape) -> None:
    left, top, side = shape.box
    right, bottom = left + side - 1, top + side - 1
    fill = RGB[shape.colour]
    if shape.kind == "circle":
        draw.ellipse((left, top, right, bottom), fill=fill)
    elif shape.kind == "square":
        draw.rectangle((left, top, right, bottom), fill=fill)
    else:
        draw.polygon([(left, bottom), (right, bottom), ((left + right) / 2, top)], fill=fill)


def is_test(scene: Scene) -> bool:
    """The held-out eighth of all scenes (a fixed hash of the scene)."""
    return zlib.crc32(repr(scene).encode()) % 8 == 0


def question(num_images: int) -> str:
    where = "" if num_images == 1 else " in the two images"
    return f"Which colour is the largest shape{where}? Answer with one word."


def draw_split(rng: random.Random, split: str, num_images: int, num_shapes: int | None) -> Scene:
    """A scene of the split: drawn again until `is_test` agrees with `split`."""
    while True:
        scene = draw_scene(rng, num_images, num_shapes)
        if is_test(scene) == (split == "test"):
            return scene


def make_rows(
    num_rows: int, seed: int, split: str, num_images: int = 1, num_shapes: int | None = None
) -> list[dict[str, Any]]:
    """`num_rows` rows of `split` ("test" or anything else = train) with `num_images` images and `num_shapes`
    shapes (None: 2-4) each, deterministic for a seed."""
    rng = random.Random(seed)
    text = question(num_images)
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    rows = []
    for index in range(num_rows):
        scene = draw_split(rng, split, num_images, num_shapes)
        rows.append(
            {
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": content}],
                "images": [render(scene, image) for image in range(num_images)],
                "ability": "vision",
                "reward_model": {"style": "rule", "ground_truth": scene.answer},
                "extra_info": {"split": split, "index": index, "question": text},
            }
        )
    return rows


def write_parquet(
    path: Path, num_rows: int, seed: int, split: str, num_images: int = 1, num_shapes: int | None = None
) -> int:
    """Write `make_rows(...)` to `path` atomically; returns the row count."""
    return write_rows(path, make_rows(num_rows, seed, split, num_images, num_shapes))


ANSWER_POOLS = ("scene", "palette")


def sft_rows(
    num_rows: int, seed: int, num_images: int, num_shapes: int | None, answer_pool: str
) -> list[dict[str, Any]]:
    """The format warm-up's chat rows of training scenes: the question with its images, then a random colour of
    the scene (`answer_pool="scene"`) or of the palette (`"palette"`) as the assistant's answer."""
    rng = random.Random(seed)
    text = question(num_images)
    content = [{"type": "image"}] * num_images + [{"type": "text", "text": text}]
    rows = []
    for _ in range(num_rows):
        scene = draw_split(rng, "train", num_images, num_shapes)
        pool = [shape.colour for shape in scene.shapes] if answer_pool == "scene" else list(COLOURS)
        answer = [{"type": "text", "text": rng.choice(pool)}]
        messages = [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        rows.append({"messages": messages, "images": [render(scene, image) for image in range(num_images)]})
    return rows


def write_sft_parquet(
    path: Path, num_rows: int, seed: int, num_images: int = 1, num_shapes: int | None = None, answer_pool: str = "scene"
) -> int:
    """Write `sft_rows(...)` in order to `path` atomically (megarl/data/sft.py rows); returns the row count."""
    if answer_pool not in ANSWER_POOLS:
        raise ValueError(f"answer_pool={answer_pool!r} is unknown; choose one of {', '.join(ANSWER_POOLS)}")
    return write_rows(path, sft_rows(num_rows, seed, num_images, num_shapes, answer_pool))
