"""The trainer's parallel layout (section ``parallelism``; Megatron's names). The data-parallel
size is what is left: world / (tp * pp * cp). ``launch_checks`` checks the layout against the
world and the model.

Example: ``ParallelArgs(tensor_model_parallel_size=0)`` raises
``tensor_model_parallel_size=0: must be >= 1 ...``.
"""

import attrs

from vime_shell.settings.common import Record, at_least, setting

SECTION = "parallelism"


def _f(default, help):
    return setting(default, help, SECTION)


@attrs.frozen(kw_only=True, slots=False)  # a base of TrainConfig
class ParallelArgs(Record):
    """Tensor, pipeline, context and expert parallel sizes."""

    tensor_model_parallel_size: int = _f(1, "tensor-parallel size")
    pipeline_model_parallel_size: int = _f(1, "pipeline-parallel size")
    context_parallel_size: int = _f(1, "context-parallel size (needs TransformerEngine)")
    num_layers_per_virtual_pipeline_stage: int | None = _f(None, "layers per virtual stage")
    num_virtual_stages_per_pipeline_rank: int | None = _f(None, "virtual stages (model chunks) "
                                                          "per pipeline rank; what uneven "
                                                          "stages take")
    expert_model_parallel_size: int = _f(1, "expert-parallel size (MoE): experts split over "
                                         "this many ranks")
    expert_tensor_parallel_size: int | None = _f(None, "tensor-parallel size inside an expert; "
                                                 "default --tensor-model-parallel-size")
    decoder_first_pipeline_num_layers: int | None = _f(None, "layers of the first pipeline "
                                                       "stage (uneven pipelines)")
    decoder_last_pipeline_num_layers: int | None = _f(None, "layers of the last pipeline stage")

    def _check(self) -> None:
        for f in attrs.fields(ParallelArgs):
            if f.name != "num_layers_per_virtual_pipeline_stage":  # launch_checks: vs layers
                at_least(f.name, getattr(self, f.name), 1)
