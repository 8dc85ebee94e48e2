"""The parity harness's device rule (tests/harness.py's docstring): only the positions where HF's
logits on the test device and on the CPU disagree beyond the tolerance take HF's CPU row; a position
where HF agrees with itself keeps its reference, so a wrong result there still fails."""
import torch

from harness import LOGIT_ATOL, apply_device_rule


def test_only_positions_where_hf_disagrees_with_itself_take_the_cpu_row():
    torch.manual_seed(0)
    on_cpu = torch.randn(4, 7)
    on_device = on_cpu.clone()
    on_device[1, 3] += 2 * LOGIT_ATOL        # HF's GPU rounding past the tolerance at position 1
    on_device[2, 0] += 0.5 * LOGIT_ATOL      # within it at position 2: the device row stays
    ref, off = apply_device_rule(on_device, on_cpu)
    assert off == [1]
    assert torch.equal(ref[1], on_cpu[1])
    assert torch.equal(ref[[0, 2, 3]], on_device[[0, 2, 3]])
    ours = ref.clone()
    ours[3, 5] += 2 * LOGIT_ATOL             # a wrong logit where HF agrees with itself
    assert (ours - ref).abs().amax(dim=-1).gt(LOGIT_ATOL).nonzero()[:, 0].tolist() == [3]


def test_no_replacement_when_the_devices_agree():
    on_cpu = torch.randn(3, 5)
    ref, off = apply_device_rule(on_cpu.clone(), on_cpu)
    assert off == [] and torch.equal(ref, on_cpu)
