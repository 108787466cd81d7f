"""The one-process probe's exchanges (experiments.adam_probe) keep what they do not send: the
error feedback the recorded probe runs rest on."""
import pytest
import torch

from experiments.adam_probe import parse_args, sign_average, sign_twice, topk_average


def _workers(seed: int, count: int = 4, n: int = 300):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(n, generator=g) for _ in range(count)]
    residuals = [torch.randn(n, generator=g) for _ in range(count)]
    return grads, residuals


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_each_exchange_conserves_the_workers_mass(seed):
    """sum of gradients + old residuals == P * average + new residuals (+ the server's, for
    the signs sent twice)."""
    sizes = [100, 150, 50]
    for exchange in ("topk", "sign", "sign2"):
        grads, residuals = _workers(seed)
        before = sum(grads) + sum(residuals)
        server = torch.randn(300, generator=torch.Generator().manual_seed(seed + 10))
        server_before = server.clone()
        if exchange == "topk":
            out = topk_average(grads, residuals, 7)
            assert all(int((r == 0).sum()) >= 7 for r in residuals)
        elif exchange == "sign":
            out = sign_average(grads, residuals, sizes)
        else:
            out = sign_twice(grads, residuals, server, sizes)
        after = 4 * out + sum(residuals)
        if exchange == "sign2":  # the server's error feedback holds the rest of the average
            after = after + 4 * (server - server_before)
        assert torch.allclose(before, after, atol=1e-4), exchange


def test_the_signs_send_one_magnitude_per_tensor():
    grads, residuals = _workers(3, count=1)
    out = sign_average(grads, residuals, [100, 200])
    assert out[:100].abs().unique().numel() == 1 and out[100:].abs().unique().numel() == 1


def test_an_unknown_variant_or_an_option_it_ignores_is_refused(capsys):
    for argv, message in ((["--variants", "nope"], "update_localfrozen"),
                          (["--variants", "dense", "--select", "sign"], "update_frozen"),
                          (["--variants", "update_frozen", "--select", "sign",
                            "--mask-momentum"], "--select topk")):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert message in capsys.readouterr().err, argv
    assert parse_args(["--variants", "update_frozen", "--mask-momentum"]).mask_momentum
