"""The kopf operator for SpecDecodeDeployment (imported as specdeploy.operator)."""
