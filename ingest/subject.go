package ingest

import (
	"fmt"
	"strings"
)

// ValidEngineID reports whether s is a protocol engine id:
// [A-Za-z0-9_-]{1,64}, not starting with '_' (reserved for kvactors' own
// subjects, such as P._node.*). Engine ids appear in NATS subjects, so this
// also guarantees they hold no '.', '*', '>' or space.
func ValidEngineID(s string) bool {
	if len(s) == 0 || len(s) > MaxEngineIDBytes || s[0] == '_' {
		return false
	}
	for i := 0; i < len(s); i++ {
		c := s[i]
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z', '0' <= c && c <= '9', c == '_', c == '-':
		default:
			return false
		}
	}
	return true
}

// ParseSubject splits subject into the engine id and the verb of
// "prefix.engine.verb" (PROTOCOL.md "Subjects"). The prefix may itself hold
// dots ("a.b"); the engine must be a valid id and the verb one non-empty
// token. The verb is not checked against the known verbs: the caller
// dispatches on it and counts the unknown ones.
func ParseSubject(prefix, subject string) (engine, verb string, err error) {
	rest, ok := strings.CutPrefix(subject, prefix)
	if !ok || prefix == "" {
		return "", "", fmt.Errorf("%w: %q does not start with prefix %q", ErrBadSubject, subject, prefix)
	}
	rest, ok = strings.CutPrefix(rest, ".")
	if !ok {
		return "", "", fmt.Errorf("%w: %q: want %s.<engine>.<verb>", ErrBadSubject, subject, prefix)
	}
	engine, verb, ok = strings.Cut(rest, ".")
	if !ok || verb == "" || strings.Contains(verb, ".") {
		return "", "", fmt.Errorf("%w: %q: want %s.<engine>.<verb>", ErrBadSubject, subject, prefix)
	}
	if !ValidEngineID(engine) {
		return "", "", fmt.Errorf("%w: %q: engine id %q is not [A-Za-z0-9_-]{1,64} or starts with the reserved _", ErrBadSubject, subject, engine)
	}
	return engine, verb, nil
}
