"""The foundation every layer stands on, torch-free where it can be: the errors a user sees
(`errors`), what a model is (`model_config`: `ModelConfig`, `Wiring`, `MoeConfig`; and the
inverse frequencies of each RoPE type, `rope_scaling`), which switches a loaded model runs
with (`features`), where a checkpoint lies (`checkpoint`), the module base that lets
layers be built empty and filled later (`module`), and which part of a model a
tensor-parallel rank holds (`parallel`), the installed package's `version`. Nothing here imports another qinfer package."""
