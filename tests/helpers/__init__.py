"""What the tests share: the real servers they start (Kafka-protocol broker, PostgreSQL,
Redis, S3), a hostile peer, plain reference implementations, and jobs run under kills."""
