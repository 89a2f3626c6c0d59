"""Helpers the metrics tests share: parse an exposition into plain lookups."""

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample


def parse(body: bytes | str) -> dict[str, tuple[str, list[Sample]]]:
    """Family name as exposed (counters with _total) -> (type, samples)."""
    text = body.decode() if isinstance(body, bytes) else body
    out: dict[str, tuple[str, list[Sample]]] = {}
    for fam in text_string_to_metric_families(text):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = (fam.type, list(fam.samples))
    return out


def value(body: bytes | str, sample_name: str, **labels: str) -> float:
    """The single sample named `sample_name` whose labels include `labels`."""
    text = body.decode() if isinstance(body, bytes) else body
    hits = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == sample_name and labels.items() <= s.labels.items()
    ]
    assert len(hits) == 1, f"{sample_name}{labels}: {len(hits)} samples"
    return hits[0]
