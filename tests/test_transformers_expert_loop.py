"""transformers' eager expert loop (which experts got tokens read on the host) under the doctor and the runtime:
each names transformers' line and the fix, never Dynamo's exception. Apart from tests/test_transformers.py: Dynamo
traces the loop for about a minute, which two test workers share better as a file of its own."""

import pytest
import torch

import piecewise
from piecewise.errors import ForwardRefused

transformers = pytest.importorskip("transformers")
from piecewise.integrations.transformers import TokenModel, enable  # noqa: E402
from test_transformers import glm_moe  # noqa: E402


def test_doctor_names_the_transformers_expert_loop():
    model = glm_moe(experts_implementation="eager", layers=2, experts=4)
    report = piecewise.doctor(TokenModel(model), torch.randint(0, 256, (9,)), torch.arange(9))
    assert not report.ok
    lines = {(b.kind, b.location.code.strip()) for b in report.blockers}
    assert ("data_dependent_shape", "expert_hit = torch.greater(expert_mask.sum(dim=(-1, -2)), 0).nonzero()") in lines
    assert all(b.location.file.endswith("modeling_glm4_moe.py") for b in report.blockers)
    assert all("piecewise.integrations.transformers.enable(model)" in b.fix for b in report.blockers)
    assert report.blockers[0].chain[0].function == "forward"  # TokenModel.forward first
    assert any("split=True" in b.fix for b in report.blockers)
    assert piecewise.doctor(TokenModel(enable(model)), torch.randint(0, 256, (9,)), torch.arange(9)).ok


def test_the_runtime_names_the_blockers_of_transformers_eager_expert_loop_instead_of_a_dynamo_error():
    """Unmodified (eager experts: which experts got tokens is read on the host), the model cannot run piecewise
    with Dynamo: the first call refuses, naming transformers' line, not with Dynamo's exception. (Traced with
    every guard kept, Dynamo gets past the loop and the refusal is the token rows read back to Python; a trace that
    stops there names the blockers and enable().)"""
    import warnings

    from piecewise.diagnostics import CaptureBlockedError

    runner = piecewise.compile(TokenModel(glm_moe(experts_implementation="eager", layers=2, experts=4)),
                               piecewise.CaptureConfig(max_tokens=16, frontend="dynamo"))
    with torch.no_grad(), warnings.catch_warnings(), pytest.raises((CaptureBlockedError, ForwardRefused)) as failure:
        warnings.simplefilter("ignore")
        runner(torch.randint(0, 256, (9,)), torch.arange(9))
    message = str(failure.value)
    assert "modeling_glm4_moe.py" in message
    if isinstance(failure.value, CaptureBlockedError):
        assert "piecewise.integrations.transformers.enable(model)" in message
    else:
        assert failure.value.kind == "token_mixing" and "goes back to Python" in message
