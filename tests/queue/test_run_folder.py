"""A new run folder never adopts another run's queue on an external Redis: the same run name there would hand it
that run's stream, version counter and pacing, and it would train another run's samples as its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pipeline.errors import ConfigError
from pipeline.queue.redis_streams import SampleQueue
from pipeline.queue.rundir import open_run
from pipeline.rundir import RUN_FILE
from tests.helpers.samples import make_group


def test_a_new_folder_on_a_redis_holding_a_run_of_that_name_is_refused(redis_url: str, run_name: str,
                                                                       tmp_path: Path) -> None:
    first = open_run(run_dir=tmp_path / "first", redis_url=redis_url, run=run_name, create=True)
    first.queue.put_many([make_group(np.random.default_rng(0), 2)])
    first.queue.redis.set(first.queue.keys.policy_version, 7)
    first.close()

    with pytest.raises(ConfigError, match=rf"already holds a run named '{run_name}' \(policy version 7, 1 stream"):
        open_run(run_dir=tmp_path / "second", redis_url=redis_url, run=run_name, create=True)
    assert not (tmp_path / "second" / RUN_FILE).exists()  # refused before the folder became a run folder

    # The run's own folder resumes it; another name starts clean beside it; the run's queue is untouched.
    again = open_run(run_dir=tmp_path / "first", redis_url=redis_url, run=run_name, create=True)
    assert again.queue.policy_version() == 7
    again.close()
    # A consumer may attach to a run's stream before the run starts: that is not another run.
    SampleQueue(first.queue.redis, f"{run_name}-b").create_group("evaluator")
    other = open_run(run_dir=tmp_path / "other", redis_url=redis_url, run=f"{run_name}-b", create=True)
    assert other.queue.policy_version() == 0
    other.close()
    theirs = SampleQueue(other.queue.redis, run_name)
    assert theirs.redis.xlen(theirs.keys.samples) == 1
