package node

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"

	"go.yaml.in/yaml/v3"
)

// readConfigFile reads a YAML mapping of flag names to scalar values
// ("" path: no file). A key that is no flag, or a value that is not a
// scalar, is an error: a typo must not fall back to a default unseen. So is
// a key given twice: one of the two values would be dropped unseen.
func readConfigFile(path string, flags []Flag) (map[string]string, error) {
	if path == "" {
		return nil, nil
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("%w: config file: %w", ErrConfig, err)
	}
	var doc, more yaml.Node
	dec := yaml.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&doc); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: config file %s: %w", ErrConfig, path, err)
	}
	// Keys in a second document (after ---) would be ignored unseen.
	if err := dec.Decode(&more); !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%w: config file %s: want one YAML document, found more (line %d)", ErrConfig, path, more.Line)
	}
	out := map[string]string{}
	if len(doc.Content) == 0 { // empty file
		return out, nil
	}
	root := doc.Content[0]
	if root.Kind != yaml.MappingNode {
		return nil, fmt.Errorf("%w: config file %s: want a mapping of flag names to values", ErrConfig, path)
	}
	known := map[string]bool{}
	for _, f := range flags {
		known[f.Name] = f.Name != configFlag
	}
	line := map[string]int{} // of each key's first appearance
	for i := 0; i+1 < len(root.Content); i += 2 {
		k, v := root.Content[i], root.Content[i+1]
		switch {
		case !known[k.Value]:
			return nil, fmt.Errorf("%w: config file %s:%d: unknown key %q (keys are serve flag names, see kvactors flags)",
				ErrConfig, path, k.Line, k.Value)
		case line[k.Value] != 0:
			return nil, fmt.Errorf("%w: config file %s:%d: key %q given twice (first at line %d)",
				ErrConfig, path, k.Line, k.Value, line[k.Value])
		case v.Kind != yaml.ScalarNode:
			return nil, fmt.Errorf("%w: config file %s:%d: %s: want a single value", ErrConfig, path, v.Line, k.Value)
		case v.Tag == "!!null": // "http: null" or "http:" would be the string "null" or ""
			return nil, fmt.Errorf("%w: config file %s:%d: %s: no value (leave the key out for its default; \"\" for an empty one)",
				ErrConfig, path, v.Line, k.Value)
		}
		line[k.Value] = k.Line
		out[k.Value] = v.Value
	}
	return out, nil
}
