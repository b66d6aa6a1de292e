"""Trainer-to-engine synchronisation: the policy-version counter and the bucketed weight broadcast."""
