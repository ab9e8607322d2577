"""Helpers shared by the tests: clients, servers, inputs and fakes (no tests here)."""
