"""Reading runs back: comparison tables (`tables`), figures (`figures`) and the HTML report (`html`).
Everything here reads `metrics.jsonl` / `summary.json` (the source of truth) and never trains."""
