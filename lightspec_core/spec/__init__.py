"""Speculation: the policy choosing each request's draft count, its cost model and acceptance
statistics, the stage profile, the proposers (one per file) and lossless verification."""
