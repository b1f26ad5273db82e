//! An offline emulator of AWS Bedrock AgentCore Runtime's data plane, for tests (being built).
