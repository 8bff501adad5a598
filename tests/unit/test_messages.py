"""The texts users read: a misspelled name gets the closest known one suggested, a far-off name
gets none, and the full list is always there; a failed handshake names where the worker's keys
came from; the servers' start-up line and the commands' help."""

from __future__ import annotations

import pytest
import zmq

from kvstore.auth import JobKeys, describe_handshake_failure
from kvstore.auth import build_parser as keygen_parser
from kvstore.codecs import codec_from_spec
from kvstore.config import KeyOrigin, ServerConfig, curve_keys_from_env
from kvstore.errors import CodecError, OptimizerError, close_match, did_you_mean
from kvstore.optimizer_spec import make_optimizer_spec
from kvstore.server.__main__ import ready_line


def test_close_match_ignores_case_and_refuses_far_off_names():
    assert close_match("topkk", ["2bit", "topk"]) == "topk"
    assert close_match("TOPK", ["2bit", "topk"]) == "topk"
    assert close_match("zip", ["2bit", "topk"]) is None
    assert close_match(3, ["2bit", "topk"]) is None  # a name of the wrong type (from the wire)


def test_did_you_mean_for_one_or_several_names():
    assert did_you_mean(["ratoi"], ["ratio", "sample"]) == " (did you mean 'ratio'?)"
    assert did_you_mean(["ratoi", "sampel", "zzz"], ["ratio", "sample"]) == (
        " (did you mean 'ratio' for 'ratoi', 'sample' for 'sampel'?)"
    )
    assert did_you_mean(["zzz"], ["ratio", "sample"]) == ""


@pytest.mark.parametrize(
    "spec, suggestion",
    [
        ({"type": "topkk"}, "unknown codec 'topkk' (did you mean 'topk'?); registered codecs: "),
        ({"type": "TopK"}, "unknown codec 'TopK' (did you mean 'topk'?); registered codecs: "),
        (
            {"type": "topk", "ratoi": 0.01},
            "unknown parameter(s) ['ratoi'] for codec 'topk' (did you mean 'ratio'?); "
            "accepted: ratio, sample",
        ),
        (
            {"type": "2bit", "treshold": 0.5},
            "unknown parameter(s) ['treshold'] for codec '2bit' (did you mean 'threshold'?)",
        ),
    ],
)
def test_a_misspelled_codec_or_parameter_gets_a_suggestion(spec, suggestion):
    with pytest.raises(CodecError) as raised:
        codec_from_spec(spec)
    assert suggestion in str(raised.value)


def test_a_far_off_codec_name_gets_the_list_and_no_suggestion():
    with pytest.raises(CodecError) as raised:
        codec_from_spec({"type": "zip"})
    message = str(raised.value)
    assert "did you mean" not in message
    assert message.startswith("unknown codec 'zip'; registered codecs: ")
    assert "topk" in message and "2bit" in message


@pytest.mark.parametrize(
    "name, params, text",
    [
        (
            "adma",
            {},
            "unknown optimizer 'adma' (did you mean 'adam'?); available: adam, dcasgd, sgd",
        ),
        ("SDG", {}, "unknown optimizer 'SDG' (did you mean 'sgd'?); available: adam, dcasgd, sgd"),
        ("rmsprop", {}, "unknown optimizer 'rmsprop'; available: adam, dcasgd, sgd"),
        (
            "sgd",
            {"momentun": 0.9},
            "optimizer 'sgd' has no hyperparameter(s) ['momentun'] (did you mean 'momentum'?); "
            "accepted: clip_gradient, learning_rate, momentum, momentum_every, nesterov, "
            "rescale_grad, wd",
        ),
        ("adam", {"lrr": 0.1}, "has no hyperparameter(s) ['lrr'] (did you mean 'lr'?)"),
        ("adam", {"colour": 1}, "has no hyperparameter(s) ['colour']; accepted: beta1, "),
    ],
)
def test_optimizer_names_and_hyperparameters(name, params, text):
    with pytest.raises(OptimizerError) as raised:
        make_optimizer_spec(name, params)
    assert text in str(raised.value)


def test_a_misspelled_mode_gets_a_suggestion():
    import kvstore  # noqa: PLC0415

    with pytest.raises(ValueError, match=r"'dist_synk' \(did you mean 'dist_sync'\?\); valid"):
        kvstore.create("dist_synk")
    with pytest.raises(ValueError) as far:
        kvstore.create("turbo")
    assert "did you mean" not in str(far.value)


def key_origin(file_name: str, env: dict[str, str]) -> KeyOrigin | None:
    """Where a worker with environment ``env`` read its key ``file_name``, as it records it."""
    keys = curve_keys_from_env("worker", env)
    return None if keys is None else keys.origins.get(file_name)


def test_key_origin_follows_the_rule_that_loads_the_keys(tmp_path):
    JobKeys.generate().write(tmp_path)
    folder = str(tmp_path / "worker")
    variable = "KVSTORE_AUTH_SERVER_PUBLIC_KEY"
    assert str(key_origin("server-public-key", {"KVSTORE_AUTH_DIR": folder})) == (
        f"KVSTORE_AUTH_DIR={folder}"
    )
    both = {"KVSTORE_AUTH_DIR": folder, variable: JobKeys.generate().server_public}
    assert key_origin("server-public-key", both) == KeyOrigin(variable)  # the variable wins
    assert key_origin("server-public-key", {"KVSTORE_AUTH_DIR": folder, variable: " "}) == (
        KeyOrigin("KVSTORE_AUTH_DIR", folder)  # a blank variable counts as unset
    )
    # a worker's folder has no server secret key; nothing set: keys handed over in code
    assert key_origin("server-secret-key", {"KVSTORE_AUTH_DIR": folder}) is None
    assert key_origin("client-secret-key", {}) is None


def test_a_handshake_the_server_could_not_check_is_not_blamed_on_the_keys():
    where = "server 0 (tcp://node1:9100)"
    failed = describe_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 500, where, True, {})
    assert failed == f"{where} could not check this worker's keys (ZAP status 500): see its log"
    refused = describe_handshake_failure(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400, where, True, {})
    assert refused.startswith(f"{where} refused this worker's client key: it is not the job's; ")


def test_keygen_help_says_how_each_role_gets_its_keys():
    text = keygen_parser().format_help()
    for shown in (
        "KVSTORE_AUTH_DIR=DIR/server kvstore-server",
        "KVSTORE_AUTH_DIR=DIR/worker python train.py",
        "KVSTORE_AUTH_SERVER_SECRET_KEY and KVSTORE_AUTH_CLIENT_PUBLIC_KEY",
        "KVSTORE_AUTH_CLIENT_SECRET_KEY and KVSTORE_AUTH_SERVER_PUBLIC_KEY",
        "(default: refuse)",
    ):
        assert shown in text, shown


@pytest.mark.parametrize(
    "rank, servers, terminal, line",
    [
        (0, 1, False, "KVSTORE_READY tcp://node1:9100"),
        (
            0,
            1,
            True,
            "kvstore-server: server 0/1 ready at tcp://node1:9100; start the workers with "
            "KVSTORE_SERVERS=tcp://node1:9100",
        ),
        (
            1,
            2,
            True,
            "kvstore-server: server 1/2 ready at tcp://node1:9100; the workers' KVSTORE_SERVERS "
            "lists the 2 servers' addresses in rank order, this one at position 1 (counting "
            "from 0)",
        ),
    ],
)
def test_the_ready_line_is_for_programs_and_the_sentence_for_people(rank, servers, terminal, line):
    config = ServerConfig(server_rank=rank, num_servers=servers, num_workers=2)
    assert ready_line(config, "tcp://node1:9100", terminal) == line
