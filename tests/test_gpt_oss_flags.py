"""miles' gpt-oss model flags (``--softmax-type``, ``--window-size``,
``--window-attn-skip-freq``, tests/snapshots/model_args/gpt-oss-20b.txt) checked against a
gpt-oss config.json, and gpt-oss's layouts refused at launch where its bridge is not built."""

import pytest

from vime_shell.models.hf_config import HfConfigSummary
from vime_shell.megatron.layout import TrainLayout
from vime_shell.run.model_checks import check_model_settings
from vime_shell.settings.flags import parse_train_config
from vime_shell.settings.megatron_args import ModelArgsError, check_architecture
from vime_shell.settings.train_config import ConfigError

# gpt-oss-20b's config.json, cut to what the checks read (24 layers, window 128 on even ones)
GPT_OSS = {"model_type": "gpt_oss", "num_hidden_layers": 24, "num_local_experts": 32,
           "num_experts_per_tok": 4, "hidden_size": 2880, "intermediate_size": 2880,
           "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 64,
           "vocab_size": 201088, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "attention_bias": True, "tie_word_embeddings": False,
           "sliding_window": 128,
           "layer_types": ["sliding_attention", "full_attention"] * 12,
           "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "rope_theta": 150000.0,
                               "original_max_position_embeddings": 4096}}
# miles' gpt-oss-20b model flags, as its model_args snapshot has them (--moe-grouped-gemm,
# CUDA-only, left out: model_checks refuses it on CPU)
MILES_GPT_OSS_20B = (
    "--num-layers 24 --hidden-size 2880 --ffn-hidden-size 2880 --num-attention-heads 64 "
    "--group-query-attention --num-query-groups 8 --kv-channels 64 "
    "--use-rotary-position-embeddings --rotary-percent 1.0 --rotary-base 150000 "
    "--max-position-embeddings 131072 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu "
    "--untie-embeddings-and-output-weights --vocab-size 201088 --softmax-type learnable "
    "--window-size 128,0 --window-attn-skip-freq 2 --no-masked-softmax-fusion "
    "--no-rope-fusion --num-experts 32 --moe-router-topk 4 --moe-aux-loss-coeff 0.0 "
    "--moe-token-dispatcher-type alltoall --moe-router-dtype fp32").split()
QWEN2 = {"model_type": "qwen2", "num_hidden_layers": 2, "hidden_size": 64,
         "num_attention_heads": 4, "sliding_window": 4, "use_sliding_window": False}


def test_miles_gpt_oss_20b_flags_pass_against_its_config():
    check_architecture(parse_train_config(MILES_GPT_OSS_20B), GPT_OSS, "/m")


@pytest.mark.parametrize("argv", [["--window-size", "127,0"], ["--window-size", "(127, 0)"],
                                  ["--window-attn-skip-freq", "[1,0]*12"],
                                  ["--softmax-type", "learnable"]])
def test_the_exact_spellings_pass(argv):
    check_architecture(parse_train_config(argv), GPT_OSS, "/m")


@pytest.mark.parametrize("argv, says", [
    (["--window-size", "64,0"], '"sliding_window": 128'),
    (["--window-size", "128,128"], "pass --window-size 127,0"),
    (["--window-attn-skip-freq", "3"], '"layer_types"'),
    (["--window-attn-skip-freq", "[0,1]*12"], '"layer_types"'),
    (["--window-attn-skip-freq", "0"], "neither a positive int"),
    (["--softmax-type", "vanilla"], "'learnable'"),
    (["--softmax-type", "off-by-one"], "'learnable'")])
def test_a_mismatch_names_the_flag_and_the_config(argv, says):
    with pytest.raises(ModelArgsError) as err:
        check_architecture(parse_train_config(argv), GPT_OSS, "/m")
    assert argv[0] in str(err.value) and says in str(err.value), str(err.value)


def test_other_families_have_no_sinks_and_no_window():
    check_architecture(parse_train_config(["--softmax-type", "vanilla"]), QWEN2, "/m")
    for argv in (["--softmax-type", "learnable"], ["--window-size", "3,0"],
                 ["--window-attn-skip-freq", "2"]):
        with pytest.raises(ModelArgsError, match=argv[0]):
            check_architecture(parse_train_config(argv), QWEN2, "/m")


@pytest.mark.parametrize("argv, flag", [
    (["--tensor-model-parallel-size", "2"], "tensor_model_parallel_size"),
    (["--expert-model-parallel-size", "2"], "expert_model_parallel_size")])
def test_gpt_oss_refuses_tp_and_ep_at_launch(argv, flag):
    summary = HfConfigSummary(model_type="gpt_oss", num_layers=2, vocab_size=128,
                              max_position_embeddings=4096, num_attention_heads=4,
                              num_key_value_heads=2, num_experts=4)
    with pytest.raises(ConfigError, match=f"{flag}.*gpt-oss"):
        check_model_settings(parse_train_config(argv), summary, TrainLayout(world_size=2, dp=1))
