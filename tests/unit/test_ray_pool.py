"""A pool read from a Ray cluster's node resources (``providers/ray_pool.py``), on ``ray.nodes()`` records."""

from __future__ import annotations

import socket

import pytest

from starverse.catalog import load_catalog
from starverse.errors import ConfigError
from starverse.planner.pool import pool_from_dict
from starverse.providers.ray_pool import RayPoolSource, nodes_from_ray, pool_dict, pool_source_for
from starverse.runtime.launch import RankSpec

CATALOG = load_catalog()
IDS = list(CATALOG.accelerators)


def _node(ip: str, resources: dict[str, float], alive: bool = True, node_id: str = "") -> dict:
    base = {"memory": 1e9, "object_store_memory": 1e8, f"node:{ip}": 1.0}
    return {"NodeID": node_id or ip, "NodeManagerAddress": ip, "Alive": alive, "Resources": {**base, **resources}}


RAW = [
    _node("10.0.0.1", {}),  # a head started with --num-cpus=0: nothing to offer
    _node("10.0.0.2", {"CPU": 16.0, "GPU": 8.0, "rtx-4090": 8.0, "accelerator_type:G": 1.0}),
    _node("10.0.0.3", {"CPU": 16.0, "rtx-4090": 4.0}),
    _node("10.0.0.4", {"CPU": 2.0}),  # a CPU node: 2 cpu devices
    _node("10.0.0.5", {"CPU": 16.0, "rtx-4090": 8.0}, alive=False),  # gone: not counted
]


def test_devices_per_node_from_custom_resources_and_cpu_nodes():
    nodes = nodes_from_ray(RAW, IDS, "ray://x:1")
    assert [(n.ip, dict(n.devices)) for n in nodes] == [
        ("10.0.0.2", {"rtx-4090": 8}), ("10.0.0.3", {"rtx-4090": 4}), ("10.0.0.4", {"cpu": 2})]


def test_pool_counts_are_the_clusters_and_prices_come_from_the_price_list_else_the_catalog():
    nodes = nodes_from_ray(RAW, IDS, "ray://x:1")
    data = pool_dict(nodes, None, "ray://x:1")
    assert data["offers"] == [
        {"owned": True, "accelerator": "cpu", "count": 2, "devices_per_node": 2},
        {"accelerator": "rtx-4090", "count": 12, "devices_per_node": 8},
    ]
    pool = pool_from_dict(data, CATALOG, "ray://x:1")
    rtx = pool.offer("rtx-4090")
    # priced as a pool file listing these devices without a price is: the catalog's cheapest on-demand offer
    as_file = pool_from_dict({"offers": [{"accelerator": "rtx-4090", "count": 12}]}, CATALOG).offer("rtx-4090")
    assert rtx.count == 12 and rtx.devices_per_node == 8 and rtx.price_per_hour == as_file.price_per_hour > 0
    assert rtx.price_source.startswith("catalog: ") and pool.offer("cpu").price_per_hour == 0
    # the operator's price list: its price, currency and mode; its count is ignored (the cluster's wins)
    prices = {"currency": "EUR", "offers": [{"accelerator": "rtx-4090", "count": 1, "price_per_hour": 0.3},
                                             {"accelerator": "cpu", "count": 1, "price_per_hour": 0.01}]}
    priced = pool_from_dict(pool_dict(nodes, prices, "ray://x:1"), CATALOG, "ray://x:1")
    assert priced.currency == "EUR" and priced.offer("rtx-4090").price_per_hour == 0.3
    assert priced.offer("rtx-4090").count == 12 and priced.offer("cpu").price_per_hour == 0.01


def test_a_resource_name_not_in_the_catalog_is_one_line_naming_it():
    raw = [_node("10.0.0.2", {"CPU": 4.0, "rtx4090": 8.0})]
    with pytest.raises(ConfigError) as e:
        nodes_from_ray(raw, IDS, "ray://10.0.0.1:6379")
    msg = str(e.value)
    assert msg.startswith("ray://10.0.0.1:6379: node 10.0.0.2 has resource 'rtx4090', which is not an accelerator "
                          "id of the catalog. Did you mean 'rtx-4090'")
    assert "To fix: start the node with --resources naming catalog ids" in msg and "\n" not in msg


def test_a_cluster_without_devices_is_an_error():
    with pytest.raises(ConfigError, match=r"^ray://h:1: the Ray cluster offers no device: no live node has an "
                                          r"accelerator resource or a CPU\. To fix: start its nodes with --resources"):
        pool_dict(nodes_from_ray([_node("10.0.0.1", {})], IDS, "ray://h:1"), None, "ray://h:1")


def test_an_unreachable_address_fails_fast_with_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens on it once closed
    src = RayPoolSource(f"ray://127.0.0.1:{port}")
    pytest.importorskip("ray")
    with pytest.raises(ConfigError, match=rf"^ray://127\.0\.0\.1:{port}: cannot reach the Ray cluster at "
                                          rf"127\.0\.0\.1:{port} \(.*\)\. To fix: start it"):
        src.pool()
    with pytest.raises(ConfigError, match=r"is not HOST:PORT"):
        RayPoolSource("ray://nohost").pool()


def test_pool_field_of_a_job_is_checked():
    assert pool_source_for({"ray": "auto"}).address == "auto"
    with pytest.raises(ConfigError, match=r"^pool: unknown field 'price'\. Did you mean 'prices'"):
        pool_source_for({"ray": "auto", "price": "p.yaml"})
    with pytest.raises(ConfigError, match=r"^pool\.ray: must be 'auto' or HOST:PORT \(got 3\)"):
        pool_source_for({"ray": 3})


class _Fixed(RayPoolSource):
    """A pool source whose cluster is a fixed list of nodes (the re-plan logic without Ray)."""

    def __init__(self, raw: list[dict]):
        super().__init__("ray://x:1")
        self.raw = raw

    def nodes(self):
        return nodes_from_ray(self.raw, IDS, self.source)


def test_replan_ranks_keep_survivors_drop_what_left_and_add_what_joined():
    survivors = [RankSpec(0, "rtx-4090", "cuda:0", 4), RankSpec(2, "cpu", "cpu", 2)]
    lost = [RankSpec(1, "rtx-4090", "cuda:0", 4)]
    # the lost device's node left; a CPU node with 2 CPUs joined
    src = _Fixed([_node("a", {"CPU": 8.0, "rtx-4090": 1.0}), _node("b", {"CPU": 3.0})])
    ranks = src.current_ranks(survivors, lost)
    assert [(r.rank, r.device_kind, r.device, r.num_threads) for r in ranks] == [
        (0, "rtx-4090", "cuda:0", 4), (1, "cpu", "cpu", 2), (2, "cpu", "cpu", 2), (3, "cpu", "cpu", 2)]
    # the lost rank's device is still there (its process died, not its node): it is re-planned on again
    again = _Fixed([_node("a", {"CPU": 8.0, "rtx-4090": 2.0}), _node("b", {"CPU": 1.0})])
    assert [r.device_kind for r in again.current_ranks(survivors, lost)] == ["rtx-4090", "cpu", "rtx-4090"]


def test_a_jobs_ray_pool_field(tmp_path):
    from starverse.elastic.job import RayPoolSettings, load_job

    (tmp_path / "good.yaml").write_text("dataset: c.txt\npool: {ray: '10.0.0.1:6379', prices: p.yaml}\n")
    assert load_job(tmp_path / "good.yaml").pool == RayPoolSettings(ray="10.0.0.1:6379", prices=str(tmp_path / "p.yaml"))
    (tmp_path / "bad.yaml").write_text("dataset: c.txt\npool: {ray: auto, price: p.yaml}\n")
    with pytest.raises(ConfigError) as e:
        load_job(tmp_path / "bad.yaml")
    assert str(e.value) == (f"{tmp_path / 'bad.yaml'}:2: pool: unknown field 'price' of a Ray pool. Did you mean "
                            "'prices'? To fix: write {ray: auto | HOST:PORT, prices: PRICE_LIST.yaml}")
    (tmp_path / "bad.yaml").write_text("dataset: c.txt\npool: {ray: 3}\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml:2: pool: ray: must be 'auto' or HOST:PORT \(got 3\)$"):
        load_job(tmp_path / "bad.yaml")

