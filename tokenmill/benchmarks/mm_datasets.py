"""The ``random-mm`` workload of ``bench serve`` (vLLM's ``--dataset-name random-mm``):
``random`` text prompts, each with random-pixel images of sizes drawn from
``--random-mm-bucket-config``, sent as base64 JPEG ``image_url`` parts of a chat message."""

from __future__ import annotations

import argparse
import ast
import base64
import dataclasses
import io
from typing import Any

import numpy as np

from tokenmill.benchmarks.common import BenchmarkError


def add_mm_dataset_args(group: Any) -> None:
    """vLLM's ``random-mm`` flags (same names and defaults)."""
    group.add_argument(
        "--random-mm-base-items-per-request",
        type=int,
        default=1,
        help="Images per request (random-mm). (default: 1)",
    )
    group.add_argument(
        "--random-mm-num-mm-items-range-ratio",
        type=float,
        default=0.0,
        help="Images per request drawn from [n*(1-r), n*(1+r)] (random-mm). (default: 0.0)",
    )
    group.add_argument(
        "--random-mm-limit-mm-per-prompt",
        default='{"image": 255}',
        help="Most images per request, as JSON (random-mm). (default: {\"image\": 255})",
    )
    group.add_argument(
        "--random-mm-bucket-config",
        default="{(256, 256, 1): 0.5, (720, 1280, 1): 0.5}",
        help="Image sizes (height, width, 1) and their probabilities (random-mm). "
        "(default: {(256, 256, 1): 0.5, (720, 1280, 1): 0.5})",
    )


def parse_bucket_config(text: str) -> tuple[list[tuple[int, int]], np.ndarray]:
    """``"{(1024, 1024, 1): 1.0}"`` -> ``([(1024, 1024)], [1.0])`` (sizes, probabilities).

    Raises:
        BenchmarkError: not a dict of ``(height, width, 1)`` -> weight, or a video bucket.
    """
    try:
        buckets = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        buckets = None
    if not isinstance(buckets, dict) or not buckets:
        raise BenchmarkError(
            f"--random-mm-bucket-config must look like '{{(1024, 1024, 1): 1.0}}', got {text!r}"
        )
    sizes, weights = [], []
    for key, weight in buckets.items():
        if not (isinstance(key, tuple) and len(key) == 3 and key[2] == 1) or weight < 0:
            raise BenchmarkError(
                f"--random-mm-bucket-config: {key!r}: only images (height, width, 1) with a "
                "non-negative probability are supported"
            )
        sizes.append((int(key[0]), int(key[1])))
        weights.append(float(weight))
    total = sum(weights)
    if total <= 0:
        raise BenchmarkError("--random-mm-bucket-config: the probabilities sum to 0")
    return sizes, np.asarray(weights) / total


def random_image_url(rng: np.random.Generator, height: int, width: int) -> str:
    """A base64 JPEG ``data:`` URL of random pixels."""
    from PIL import Image

    pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="JPEG")
    return "data:image/jpeg;base64," + base64.b64encode(buf.getvalue()).decode()


def add_images(samples: list[Any], args: argparse.Namespace) -> list[Any]:
    """``samples`` (random text requests) with their images drawn per the flags.

    Raises:
        BenchmarkError: invalid counts or buckets.
    """
    n, ratio = args.random_mm_base_items_per_request, args.random_mm_num_mm_items_range_ratio
    if n < 0 or not 0.0 <= ratio <= 1.0:
        raise BenchmarkError(
            "--random-mm-base-items-per-request must be >= 0 and "
            "--random-mm-num-mm-items-range-ratio in [0, 1]"
        )
    try:
        limit = int(ast.literal_eval(args.random_mm_limit_mm_per_prompt).get("image", 0))
    except (ValueError, SyntaxError, AttributeError):
        raise BenchmarkError(
            "--random-mm-limit-mm-per-prompt must be like '{\"image\": 1}'"
        ) from None
    sizes, probs = parse_bucket_config(args.random_mm_bucket_config)
    rng = np.random.default_rng(args.seed)
    low, high = int(np.floor(n * (1 - ratio))), int(np.ceil(n * (1 + ratio)))
    out = []
    for sample in samples:
        count = min(int(rng.integers(low, high + 1)), limit)
        picks = rng.choice(len(sizes), size=count, p=probs)
        urls = tuple(random_image_url(rng, *sizes[i]) for i in picks)
        out.append(dataclasses.replace(sample, images=urls))
    return out
