// Command command is a test guest built as a command module (not a
// reactor): its _start runs main and exits, so the host must refuse it.
package main

//go:wasmexport handle_request
func handleRequest() int64 { return 1 }

func main() {}
