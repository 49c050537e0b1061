"""The exercise notebooks' text: contract, hints, checks, engine cell; their code comes
from the package (see ``microvllm/course/build.py``). One module per exercise, in the
order of the lectures they follow."""

from microvllm.course.specs import (block_pool, decode_kernel, detokenizer, model_runner, prefix_cache,
                                    sampler, scheduler)

EXERCISES = [detokenizer.EXERCISE, block_pool.EXERCISE, prefix_cache.EXERCISE, scheduler.EXERCISE,
             decode_kernel.EXERCISE, sampler.EXERCISE, model_runner.EXERCISE]
