"""``--save-hf`` writes the config's dtype (or ``--save-hf-dtype``), not the trainer's fp32."""


def test_export_dtype_follows_the_config(tmp_path):
    import json

    import torch

    from vime_shell.models.hf_config import read_config_summary
    from vime_shell.run.hf_save import as_export_dtype, save_hf_path

    (tmp_path / "config.json").write_text(json.dumps(
        {"model_type": "qwen2", "num_hidden_layers": 2, "vocab_size": 8,
         "torch_dtype": "bfloat16"}))
    assert read_config_summary(tmp_path).dtype == "bfloat16"
    out = as_export_dtype({"w": torch.ones(2), "i": torch.arange(2)}, "bfloat16")
    assert (out["w"].dtype, out["i"].dtype) == (torch.bfloat16, torch.int64)
    assert as_export_dtype({"w": torch.ones(2)}, None)["w"].dtype == torch.float32
    assert save_hf_path("out/hf_{rollout_id}", 20) == save_hf_path("out/hf_20", 0)
