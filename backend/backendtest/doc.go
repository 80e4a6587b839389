// Package backendtest is the conformance suite every backend.Backend runs:
// shm in its ordinary tests, cuda in its cuda-tagged tests. It reaches device
// memory only through the Harness, so it knows nothing about how a backend
// stores it, and compares every byte of both sides against a model after
// each step, so a copy that lands in the wrong place or spills over its range
// is caught, not only a copy that is missing.
package backendtest
