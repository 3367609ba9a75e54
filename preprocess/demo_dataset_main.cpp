// lorapipe-demo-dataset DIR: writes the bundled demo dataset (see demo_dataset.h).
#include <cstdio>
#include <exception>

#include "preprocess/demo_dataset.h"
#include "runtime/exit_code.h"

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: lorapipe-demo-dataset DIR\n");
    return 2;
  }
  try {
    const auto images = lorapipe::preprocess::write_demo_dataset(argv[1]);
    std::printf("wrote %zu demo images to %s/%s\n", images.size(), argv[1],
                lorapipe::preprocess::kDemoFolder);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorapipe-demo-dataset: %s\n", e.what());
    return lorapipe::runtime::kExitError;  // a failure, as every stage's
  }
}
