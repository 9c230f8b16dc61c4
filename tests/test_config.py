import pytest

from piecewise import CaptureConfig
from piecewise.config import sglang_sizes, vllm_sizes


def test_vllm_ladder_has_51_sizes_at_512():
    sizes = CaptureConfig().sizes
    assert len(sizes) == 51 and sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512
    assert vllm_sizes(512) == sizes


def test_sglang_ladder_has_58_sizes_at_8192():
    sizes = CaptureConfig(max_tokens=8192, size_schedule="sglang").sizes
    assert len(sizes) == 58 and sizes[0] == 4 and sizes[-1] == 8192
    assert sglang_sizes(8192) == sizes


def test_max_tokens_off_the_ladder_is_still_captured():
    assert CaptureConfig(max_tokens=100).sizes[-2:] == [96, 100]


def test_explicit_sizes_are_sorted():
    assert CaptureConfig(capture_sizes=[8, 1, 4], max_tokens=8).sizes == [1, 4, 8]


@pytest.mark.parametrize(
    "kwargs, field, bad",
    [
        ({"capture_sizes": [1, 2, 2]}, "capture_sizes", "[2]"),
        ({"capture_sizes": [0, 4]}, "capture_sizes", "[0]"),
        ({"capture_sizes": [-3]}, "capture_sizes", "[-3]"),
        ({"capture_sizes": [8, 1024], "max_tokens": 512}, "capture_sizes", "[1024]"),
        ({"compiler": "tvm"}, "compiler", "'tvm'"),
        ({"size_schedule": "trt"}, "size_schedule", "'trt'"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"splitting_ops": "ns::attn"}, "splitting_ops", "'ns::attn'"),
        ({"splitting_ops": ("attn",)}, "splitting_ops", "['attn']"),
        ({"strict": "yes"}, "strict", "'yes'"),
    ],
)
def test_invalid_values_name_the_field_and_value(kwargs, field, bad):
    with pytest.raises(ValueError) as info:
        CaptureConfig(**kwargs)
    assert f"CaptureConfig.{field}" in str(info.value) and bad in str(info.value)


def test_unknown_option_is_an_error():
    with pytest.raises(TypeError, match="cuda_graph_sizes"):
        CaptureConfig(cuda_graph_sizes=[1])
