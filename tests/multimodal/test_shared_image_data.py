"""SharedImageData: one copy of an image's encoder inputs for the requests that carry it."""

from __future__ import annotations

import gc

import numpy as np
import pytest

from tokenmill.multimodal.inputs import (
    MultiModalFeature,
    PackedArray,
    SharedImageData,
    without_data,
)


def _feature(identifier: str, value: float) -> MultiModalFeature:
    data = {"pixel_values": PackedArray.pack(np.full((2, 3), value, np.float32))}
    return MultiModalFeature("image", identifier, offset=1, length=2, data=data)


def test_children_without_data_get_the_first_ones_copy():
    shared = SharedImageData()
    first = [_feature("a" * 64, 1.0)]
    shared.share(first)
    [child] = without_data(first)
    assert not child.data and (child.identifier, child.offset, child.length) == ("a" * 64, 1, 2)
    shared.share([child])
    assert child.data is first[0].data
    again = [_feature("a" * 64, 1.0)]  # the same image sent again: its copy is dropped
    shared.share(again)
    assert again[0].data is first[0].data


def test_data_is_held_while_a_request_holds_it():
    shared = SharedImageData()
    first = [_feature("b" * 64, 2.0)]
    shared.share(first)
    del first
    gc.collect()
    with pytest.raises(ValueError, match="without its data"):
        shared.share(without_data([_feature("b" * 64, 2.0)]))


def test_a_worker_in_the_same_process_keeps_the_cores_copy_alive():
    """The engine core and an in-process worker (one GPU, or CPU) each share the same
    feature objects: the core's first, then the worker's when the request is scheduled. The
    worker wrapped the core's copy in one of its own and replaced it, so the core's entry
    lost its last holder: a child of an ``n > 1`` request that reached the core after that
    step was refused ("arrived without its data"), a 400 on the server."""
    core, worker = SharedImageData(), SharedImageData()
    first = [_feature("c" * 64, 3.0)]
    core.share(first)
    worker.share(first)  # the step that schedules the first child, in the same process
    gc.collect()
    [child] = without_data(first)
    core.share([child])
    assert child.data is first[0].data
