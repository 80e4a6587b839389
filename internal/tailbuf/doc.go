// Package tailbuf keeps the last bytes written to it: a child process's
// stderr quoted in an error, a node's log that a test prints only if it
// fails. Whatever is written, it holds at most twice its bound.
package tailbuf
