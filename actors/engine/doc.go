// Package engine is the engine actor: one per registered engine. It owns the
// engine's epoch and batch sequence (duplicates ignored, gaps counted, a new
// epoch resets the engine), routes each batch's events to one request actor
// per request (spawning it on added), answers status, and supervises its
// request actors: a failed one is stopped, and its request released as
// aborted, logged and counted, while the engine and other requests go on.
package engine
