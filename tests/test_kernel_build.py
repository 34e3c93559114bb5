"""The kernels' library as it is built: a compiler error is one line that names the source
the compiler stopped on (the library has one source per weight format or op)."""

from __future__ import annotations

import pytest

from qinfer.kernels import build


@pytest.fixture(scope="module", autouse=True)
def compiler() -> None:
    if not build.on_x86() or build._missing_tool() is not None:
        pytest.skip("no compiler and ninja to build with")


def test_a_failed_build_names_the_source_that_failed(tmp_path):
    """Two sources, the second wrong: the reason names it and quotes the compiler's error."""
    good, bad = tmp_path / "good.cpp", tmp_path / "bad.cpp"
    good.write_text("int one() { return 1; }\n")
    bad.write_text("int two() { return undeclared; }\n")
    reason = build.compile_library([good, bad], tmp_path / "build", name="qinfer_test_broken")
    assert reason is not None and "\n" not in reason
    assert reason.startswith("building bad.cpp failed (RuntimeError: "), reason
    assert "bad.cpp:1:" in reason and "undeclared" in reason, reason
