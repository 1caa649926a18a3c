"""The token pipeline: chat template, tokenizer, incremental detokenizer, stop strings,
token budget."""

from penstock.errors import PreprocessorLoadError
from penstock.preprocess.budget import check_prompt_chars, check_token_budget, prompt_char_limit
from penstock.preprocess.detokenizer import IncrementalDetokenizer
from penstock.preprocess.preprocessor import Preprocessor
from penstock.preprocess.stop_strings import StopStringMatcher

__all__ = [
    "IncrementalDetokenizer",
    "Preprocessor",
    "PreprocessorLoadError",
    "StopStringMatcher",
    "check_prompt_chars",
    "check_token_budget",
    "prompt_char_limit",
]
