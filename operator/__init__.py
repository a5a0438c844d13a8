"""The pdserve operator: InferenceService CRD -> prefill/decode pools, services, autoscalers, status."""
