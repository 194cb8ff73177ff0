"""Where an image request's time goes: the front end's per-image work and the vision tower.

    python3 benchmarks/device/vision_profile.py MODEL_DIR [--images 1,2,4,8] [--size 1024]

``MODEL_DIR`` is a Qwen2.5-VL folder (``make_vl_model.py``). Prints ``VPROF`` lines:

- front end, per ``--size`` square JPEG: decode (PIL), the model's image processor (the
  class ``AutoImageProcessor`` picks, and the fast one where transformers has it), the
  content hash and the packing of the processed arrays for the engine;
- the vision tower as tokenmill builds it (``qwen2_5_vl._vision_tower``, bf16, random
  weights) over N images at once: wall and CUDA-event time per call and per image, then a
  torch.profiler table of the largest N's call (top ops by CUDA time, and host time), to
  tell kernel time from launch and Python time.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import time

import numpy as np


def log(*parts: object) -> None:
    print("VPROF", *parts, flush=True)


def front_end(model_dir: str, size: int) -> None:
    from PIL import Image
    from transformers import AutoImageProcessor

    from tokenmill.multimodal.inputs import PackedArray
    from tokenmill.multimodal.processor import MultiModalProcessor, image_hash

    rng = np.random.default_rng(0)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(buf, "JPEG")
    data = buf.getvalue()
    log(f"front: JPEG of {size}x{size}: {len(data) / 1e3:.0f} kB")

    def timed(fn, repeat: int = 5) -> float:
        fn()
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    image = Image.open(io.BytesIO(data)).convert("RGB")
    log(f"front: decode {timed(lambda: Image.open(io.BytesIO(data)).convert('RGB')):.1f} ms")
    log(f"front: image_hash {timed(lambda: image_hash(image)):.1f} ms")
    for use_fast in (None, True, False):
        try:
            proc = AutoImageProcessor.from_pretrained(
                model_dir, **({} if use_fast is None else {"use_fast": use_fast})
            )
        except Exception as e:  # noqa: BLE001 - report and go on
            log(f"front: processor use_fast={use_fast}: {type(e).__name__}: {e}")
            continue
        ms = timed(lambda p=proc: p(images=[image], return_tensors="np"))
        out = proc(images=[image], return_tensors="np")
        log(f"front: processor use_fast={use_fast} {type(proc).__name__}: {ms:.1f} ms, "
            f"pixel_values {tuple(out['pixel_values'].shape)} {out['pixel_values'].dtype}")
    pixels = out["pixel_values"]
    log(f"front: PackedArray.pack {timed(lambda: PackedArray.pack(pixels)):.1f} ms")
    config = json.load(open(os.path.join(model_dir, "config.json")))
    mm = MultiModalProcessor(model_dir, config, {"image": 1})
    ids = [1, 2, int(config["image_token_id"]), 3]
    log(f"front: MultiModalProcessor.process {timed(lambda: mm.process(ids, [image])):.1f} ms")


def tower(model_dir: str, counts: list[int], size: int) -> None:
    import torch
    from PIL import Image
    from transformers import AutoImageProcessor

    from tokenmill.model.models.qwen2_5_vl import _vision_tower

    config = json.load(open(os.path.join(model_dir, "config.json")))
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        visual = _vision_tower(config["vision_config"]).eval()
    torch.set_default_dtype(torch.float32)
    with torch.no_grad():
        for p in visual.parameters():
            p.normal_(0, 0.02)
    proc = AutoImageProcessor.from_pretrained(model_dir)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
    out = proc(images=[image], return_tensors="np")
    one = torch.from_numpy(out["pixel_values"]).cuda().to(torch.bfloat16)
    grid1 = torch.from_numpy(np.asarray(out["image_grid_thw"])).cuda()

    def run(n: int):
        return visual(one.repeat(n, 1), grid_thw=grid1.repeat(n, 1))

    for n in counts:
        with torch.no_grad():
            run(n)
            torch.cuda.synchronize()
            walls, gpus = [], []
            for _ in range(3):
                start_ev, end_ev = torch.cuda.Event(True), torch.cuda.Event(True)
                start = time.perf_counter()
                start_ev.record()
                run(n)
                end_ev.record()
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - start)
                gpus.append(start_ev.elapsed_time(end_ev))
        wall, gpu = 1e3 * statistics.median(walls), statistics.median(gpus)
        log(f"tower: {n} image(s) of {size}x{size} ({one.shape[0]} patches each): wall "
            f"{wall:.1f} ms, GPU {gpu:.1f} ms, {gpu / n:.1f} ms/image")
    n = counts[-1]
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        run(n)
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=18)
    for line in table.splitlines():
        log("prof-cuda", line)
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=12)
    for line in table.splitlines():
        log("prof-cpu", line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir")
    parser.add_argument("--images", default="1,2,4,8")
    parser.add_argument("--size", type=int, default=1024)
    parser.add_argument("--skip-tower", action="store_true")
    args = parser.parse_args()
    front_end(args.model_dir, args.size)
    if not args.skip_tower:
        tower(args.model_dir, [int(x) for x in args.images.split(",")], args.size)


if __name__ == "__main__":
    main()
