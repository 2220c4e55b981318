"""Scores of shakespeare_gen: exact match, the length of the common prefix with the true text, the length."""

import os


def process_results(doc: dict, results: list[str]) -> dict:
    generation, target = results[0], doc["target"]
    return {"exact_match": float(generation == target),
            "prefix_chars": float(len(os.path.commonprefix([generation, target]))),
            "gen_chars": float(len(generation))}
