package conflist

import (
	"fmt"
	"io"
	"os"
)

// ReadFile reads a config file, refusing anything larger than MaxFileSize so
// a runaway file cannot exhaust memory.
func ReadFile(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, MaxFileSize+1))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	if len(data) > MaxFileSize {
		return nil, invalid(path, "file is larger than %d bytes", MaxFileSize)
	}
	return data, nil
}
