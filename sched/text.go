package sched

import "fmt"

// UnmarshalText reads a Phase written by MarshalText (status clients).
func (p *Phase) UnmarshalText(b []byte) error {
	for i, n := range phaseNames {
		if n == string(b) {
			*p = Phase(i)
			return nil
		}
	}
	return fmt.Errorf("unknown phase %q", b)
}

// UnmarshalText reads a DeferReason written by MarshalText.
func (r *DeferReason) UnmarshalText(b []byte) error {
	for i, n := range deferNames {
		if n == string(b) {
			*r = DeferReason(i)
			return nil
		}
	}
	return fmt.Errorf("unknown defer reason %q", b)
}
