// Package engine is the engine actor: one per registered engine. It owns the
// engine's epoch and batch sequence (duplicates ignored, gaps counted, a new
// epoch resets the engine), routes each batch's events to one request actor
// per request (spawning it on added), answers status, and supervises its
// request actors: a failed one is stopped, its queued copies cancelled, and
// its request released as aborted once none of its copies runs (the
// transfer actor's Drain), logged and counted, while the engine and other
// requests go on.
package engine
