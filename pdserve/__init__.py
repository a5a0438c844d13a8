"""pdserve: disaggregated prefill/decode LLM serving, Kubernetes-native."""
__version__ = "0.1.0"
