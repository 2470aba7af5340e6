"""Kernel provenance from Inductor's output code: real torch 2.13 CPU wrappers (made by
``tests/data/cpu/generate.py``) and a Triton wrapper in the torch 2.11 CUDA format (as seen on
the H200: a comment block above each ``async_compile.triton`` definition and a comment above each
``.run(`` call site)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any, ClassVar

import pytest

from pytest_opprof.capture import provenance as provenance_module
from pytest_opprof.capture.provenance import aten_name, decode_kernel_name, parse_provenance

CPU = Path(__file__).resolve().parents[1] / "data" / "cpu"
KNOWN = ("aten::add", "aten::addmm", "aten::convolution", "aten::mean", "aten::relu", "aten::t")

TRITON_WRAPPER = """
from torch._inductor.async_compile import AsyncCompile
async_compile = AsyncCompile()


# kernel path: /tmp/torchinductor_root/ab/cab.py
# Topologically Sorted Source Nodes: [mul, relu], Original ATen: [aten.mul, aten.relu]
# Source node to ATen node mapping:
#   mul => mul
#   relu => relu
# Graph fragment:
#   %relu : [num_users=1] = call_function[target=torch.ops.aten.relu.default](args = (%conv,))
triton_poi_fused_mul_relu_9 = async_compile.triton('triton_poi_fused_mul_relu_9', '''
import triton
import triton.language as tl
# Topologically Sorted Source Nodes: [decoy], Original ATen: [aten.decoy_inside_kernel_source]

@triton.jit
def triton_poi_fused_mul_relu_9(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
''', device_str='cuda')


# kernel path: /tmp/torchinductor_root/cd/ccd.py
# Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]
triton_poi_fused_add_1 = async_compile.triton('triton_poi_fused_add_1', '''
@triton.jit
def triton_poi_fused_add_1(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
''', device_str='cuda')


# kernel path: /tmp/torchinductor_root/ef/cef.py
# Unsorted Source Nodes: [mul, add_3], Original ATen: [aten.mul, aten.add]
triton_poi_fused_add_mul_10 = async_compile.triton('triton_poi_fused_add_mul_10', '''
@triton.jit
def triton_poi_fused_add_mul_10(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
''', device_str='cuda')


# kernel path: /tmp/torchinductor_root/gh/cgh.py
# Source Nodes: [x_se_1, x_se_2], Original ATen: [aten.convolution, aten.relu]
# x_se_1 => convolution_9
triton_poi_fused_convolution_relu_14 = async_compile.triton('triton_', '''
@triton.jit
def triton_(in_out_ptr0, xnumel, XBLOCK : tl.constexpr):
    pass
''')


triton_red_fused_sum_2 = async_compile.triton('triton_red_fused_sum_2', '''
@triton.jit
def triton_red_fused_sum_2(in_ptr0, out_ptr0, xnumel, rnumel, XBLOCK : tl.constexpr):
    pass
''', device_str='cuda')


async_compile.wait(globals())
del async_compile

class Runner:
    def call(self, args):
        arg0_1, arg1_1, arg2_1 = args
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            # Topologically Sorted Source Nodes: [conv2d], Original ATen: [aten.convolution]
            buf0 = extern_kernels.convolution(arg2_1, arg0_1, stride=(1, 1), bias=None)
            assert_size_stride(buf0, (32, 32, 32, 32), (32768, 1024, 32, 1), 'aten.convolution')
            buf1 = buf0; del buf0  # reuse
            # Topologically Sorted Source Nodes: [relu], Original ATen: [aten.relu, aten.clone]
            stream0 = get_raw_stream(0)
            triton_poi_fused_mul_relu_9.run(buf1, arg1_1, 1048576, stream=stream0)
            # Topologically Sorted Source Nodes: [linear], Original ATen: [aten.t, aten.addmm]
            extern_kernels.addmm(arg1_1, buf1, reinterpret_tensor(arg0_1, (8, 16), (1, 8)), out=b)
            buf3 = empty_strided_cuda((8, ), (1, ), torch.float32)
            stream0 = get_raw_stream(0)
            triton_red_fused_sum_2.run(b, buf3, 8, 16, stream=stream0)
            # Topologically Sorted Source Nodes: [add], Original ATen: [aten.add]
            stream0 = get_raw_stream(0)
            triton_poi_fused_add_1.run(buf3, 8, stream=stream0)
            # Topologically Sorted Source Nodes: [mul, sum_1], Original ATen: [aten.mul, aten.sum]
            triton_poi_fused_add_mul_10.run(buf3, 8, stream=stream0)
            # Topologically Sorted Source Nodes: [linear_1], Original ATen: [aten.mm]
            buf5 = torch.ops.aten.mm.default(buf3, arg0_1)
            triton_poi_fused_convolution_relu_14.run(buf5, 8, stream=stream0)
        return (buf5, )
"""


def test_triton_definition_and_call_site_comments() -> None:
    found = parse_provenance(TRITON_WRAPPER)
    assert found == {
        # Definition site first, then what the call site adds.
        "triton_poi_fused_mul_relu_9": ["aten::mul", "aten::relu", "aten::clone"],
        "triton_poi_fused_add_1": ["aten::add"],
        # "Unsorted" is read like "Topologically Sorted".
        "triton_poi_fused_add_mul_10": ["aten::mul", "aten::add", "aten::sum"],
        # Older releases: "# Source Nodes:", and the non-unique 'triton_' source name.
        "triton_poi_fused_convolution_relu_14": ["aten::convolution", "aten::relu"],
        # No comment of its own: decoded from its name with the module's vocabulary.
        "triton_red_fused_sum_2": ["aten::sum"],
    }


def test_a_comment_above_an_extern_call_is_not_given_to_the_next_kernel() -> None:
    found = parse_provenance(TRITON_WRAPPER)
    # The [aten.t, aten.addmm] comment belongs to extern_kernels.addmm, the [aten.mm] one to
    # torch.ops.aten.mm: neither reaches the Triton kernel launched after them.
    assert "aten::addmm" not in found["triton_red_fused_sum_2"]
    assert "aten::mm" not in found["triton_poi_fused_convolution_relu_14"]


def test_comments_inside_kernel_source_are_ignored() -> None:
    found = parse_provenance(TRITON_WRAPPER)
    assert not any("decoy" in op for ops in found.values() for op in ops)


def test_prefix_named_kernels_are_not_confused() -> None:
    source = TRITON_WRAPPER.replace("triton_poi_fused_add_mul_10", "triton_poi_fused_add_10")
    found = parse_provenance(source)
    assert found["triton_poi_fused_add_1"] == ["aten::add"]
    assert found["triton_poi_fused_add_10"] == ["aten::mul", "aten::add", "aten::sum"]


def test_real_cpu_wrapper_of_torch_2_13() -> None:
    source = (CPU / "inductor.output_code.txt").read_text()
    assert "Original ATen" in source  # only above extern calls: cpp kernels carry none
    assert parse_provenance(source, KNOWN) == {
        "cpp_fused_convolution_0": ["aten::convolution"],
        "cpp_fused_mean_relu_1": ["aten::mean", "aten::relu"],
        "cpp_fused_relu_2": ["aten::relu"],
        "cpp_fused_add_3": ["aten::add"],
    }


def test_kernel_names_are_decoded_only_from_known_ops() -> None:
    source = (CPU / "inductor.output_code.txt").read_text()
    found = parse_provenance(source)  # vocabulary: the ops this module's comments name
    assert found["cpp_fused_mean_relu_1"] == ["aten::mean", "aten::relu"]
    assert "cpp_fused_add_3" not in found  # aten.add appears in no comment: not guessed


def test_kernel_profile_record_function_names_are_aliases() -> None:
    source = (CPU / "inductor_kernel_profile.output_code.txt").read_text()
    found = parse_provenance(source, KNOWN)
    assert found["graph_0_cpp_fused_mean_relu_1"] == found["cpp_fused_mean_relu_1"]
    assert found["graph_0_cpp_fused_add_3"] == ["aten::add"]


def test_graph_break_wrappers_keep_graph_ids_apart() -> None:
    source = (CPU / "graph_break.output_code.txt").read_text()
    found = parse_provenance(source, KNOWN)
    assert found["graph_0_cpp_fused_relu_2"] == ["aten::relu"]
    assert found["graph_1_cpp_fused_add_0"] == ["aten::add"]
    assert "graph_1_cpp_fused_relu_2" not in found


def test_committed_provenance_fixtures_match_the_parser() -> None:
    """The ``*.provenance.json`` files came from ``collect_inductor_provenance`` on torch 2.13."""
    for variant in ("inductor", "inductor_kernel_profile", "graph_break"):
        collected = json.loads((CPU / f"{variant}.provenance.json").read_text())
        parsed = parse_provenance((CPU / f"{variant}.output_code.txt").read_text(), KNOWN)
        assert collected == parsed, variant


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("cpp_fused_mean_relu_1", ["aten::mean", "aten::relu"]),
        (
            "triton_red_fused__native_batch_norm_legit_no_training_convolution_mean_relu_2",
            [
                "aten::_native_batch_norm_legit_no_training",
                "aten::convolution",
                "aten::mean",
                "aten::relu",
            ],
        ),
        ("triton_per_fused_gelu_native_layer_norm_4", ["aten::gelu", "aten::native_layer_norm"]),
        ("triton_poi_fused_relu_mean_3", []),  # not in Inductor's sorted order
        ("triton_poi_fused_unknownop_3", []),
        ("triton_poi_fused_0", []),
        ("extern_kernels_mm", []),
    ],
)
def test_decode_kernel_name(name: str, expected: list[str]) -> None:
    ops = (
        "aten::mean",
        "aten::relu",
        "aten::convolution",
        "aten::_native_batch_norm_legit_no_training",
        "aten::native_batch_norm",
        "aten::native_layer_norm",
        "aten::layer_norm",
        "aten::gelu",
        "aten::norm",
        "aten::native",  # a decoy a greedy split would take
    )
    vocabulary = {op.partition("::")[2]: op for op in ops}
    assert decode_kernel_name(name, vocabulary) == expected


@pytest.mark.parametrize(
    ("text", "name"),
    [
        ("aten.convolution", "aten::convolution"),
        (" aten._native_batch_norm_legit", "aten::_native_batch_norm_legit"),
        ("prims.convert_element_type", "prims::convert_element_type"),
        ("auto_functionalized", "auto_functionalized"),
    ],
)
def test_aten_name(text: str, name: str) -> None:
    assert aten_name(text) == name


def test_modules_of_every_cache_attribute_are_read_once(tmp_path: Path) -> None:
    def module(name: str, text: str) -> types.ModuleType:
        path = tmp_path / f"{name}.py"
        path.write_text(text)
        made = types.ModuleType(name)
        made.__file__ = str(path)
        return made

    a = module("a", "# a")
    b = module("b", "# b")
    c = module("c", "# c")
    gone = types.ModuleType("gone")
    gone.__file__ = str(tmp_path / "deleted.py")

    class Cache:  # torch 2.11/2.13 keep the first two; releases before 2.5 kept "cache"
        modules: ClassVar = [a, b, a, gone]
        modules_no_attr: ClassVar = {"b": b}
        cache: ClassVar = {"c": c}

    assert list(provenance_module._module_sources(Cache)) == ["# a", "# b", "# c"]

    class Empty:
        pass

    assert list(provenance_module._module_sources(Empty)) == []


@pytest.mark.slow
def test_collect_after_a_real_cpu_compile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    def model(x: Any) -> Any:
        return torch.relu(x * 2.0).sum(dim=1)

    torch._dynamo.reset()
    compiled = torch.compile(model)
    x = torch.randn(4, 8)
    torch.testing.assert_close(compiled(x), model(x))
    found = provenance_module.collect_inductor_provenance()
    ours = {name: ops for name, ops in found.items() if name.startswith("cpp_fused_mul_relu_sum")}
    assert list(ours.values()) == [["aten::mul", "aten::relu", "aten::sum"]]
    torch._dynamo.reset()
