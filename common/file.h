#pragma once
// Writing a whole file with every step checked: a full disk, a file-size limit or a failing close
// is an Error naming the file and the system's reason, and no half-written file is left under
// `path`. (std::ofstream reports none of that by itself, and LibTorch's writers end the process.)

#include <filesystem>
#include <string_view>

namespace lorapipe {

// Writes `bytes` to `path` (created or truncated); with `sync`, flushed to the disk before it
// returns. On failure removes `path` and throws lorapipe::Error.
void write_file(const std::filesystem::path& path, std::string_view bytes, bool sync);

}  // namespace lorapipe
