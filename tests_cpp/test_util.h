#pragma once
// Helpers shared by the GoogleTest files.
#include <c10/util/Exception.h>
#include <gtest/gtest.h>

#include <functional>
#include <string>

namespace dino_opt::testing {

// Expects `call` to throw a c10::Error whose message contains `fragment`.
inline void expect_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected an error containing: " << fragment;
  } catch (const c10::Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message was: " << e.what();
  }
}

}  // namespace dino_opt::testing
