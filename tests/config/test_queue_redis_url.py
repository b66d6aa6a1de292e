"""``queue.redis_url`` takes every URL the connection layer builds a client for, cluster ones included, and refuses
other schemes without echoing the URL (its password)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.errors import ConfigError

RECIPE = Path(__file__).parents[2] / "recipes" / "cpu-moe.toml"


@pytest.mark.parametrize("url", [
    "redis://127.0.0.1:6379/0",
    "rediss://user:pw@redis.example:6380/0",
    "unix:///tmp/redis.sock",
    "redis+cluster://user:s3cret@10.0.0.1:7000,10.0.0.2:7001",
    "rediss+cluster://10.0.0.1:7000?ssl_ca_certs=/etc/ca.pem",
])
def test_the_recipe_takes_every_scheme_the_connection_layer_does(url: str) -> None:
    assert load_config(RECIPE, [f"queue.redis_url={json.dumps(url)}"]).queue.redis_url == url


def test_an_unknown_scheme_is_refused_without_echoing_the_password() -> None:
    with pytest.raises(ConfigError, match=r"'http' is not a Redis URL scheme.*redis\+cluster://") as e:
        load_config(RECIPE, ['queue.redis_url="http://user:s3cret@10.0.0.1:7000"'])
    assert "s3cret" not in str(e.value)
