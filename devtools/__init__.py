"""Stand-ins for the outside world, used by tests, demos and benchmarks: the local Kafka
broker manager (``kafka_broker``, ``kvwarm kafka``) and a vLLM-protocol KV event
publisher (``vllm_engine``). May import any kvwarm package; no product package imports
this one (the CLI's command table names ``devtools.kafka_cli`` by string)."""
