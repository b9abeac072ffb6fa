from .params import SamplingParams, SamplingParamsError

__all__ = ["SamplingParams", "SamplingParamsError"]
