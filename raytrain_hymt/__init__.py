"""raytrain_hymt: fine-tune Hunyuan-MT-7B on parallel corpora with Ray Train + DeepSpeed."""

__version__ = "0.1.0"
