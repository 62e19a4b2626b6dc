// Chat template rendering, checked against the exact strings each family's
// official template produces.
#include "coordinator/chat_template.h"

#include "gtest/gtest.h"

namespace ellm::coord {
namespace {

const char kQwen25Marker[] =
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}{%- endif %} <|im_start|>";

TEST(ChatTemplate, RecognisesFamiliesByTheirMarkers) {
  EXPECT_EQ(ChatTemplate::FromGgufTemplate("... <|im_start|> ...").format(), ChatFormat::kChatMl);
  EXPECT_EQ(ChatTemplate::FromGgufTemplate("<|start_header_id|>").format(), ChatFormat::kLlama3);
  EXPECT_EQ(ChatTemplate::FromGgufTemplate("{{ '[INST] ' }}").format(), ChatFormat::kLlama2);
  EXPECT_EQ(ChatTemplate::FromGgufTemplate("{{ '### Human:' }}").format(), ChatFormat::kNone);
  EXPECT_EQ(ChatTemplate::FromGgufTemplate("").format(), ChatFormat::kNone);
}

TEST(ChatTemplate, ChatMlExactWithQwenDefaultSystem) {
  ChatTemplate t = ChatTemplate::FromGgufTemplate(kQwen25Marker);
  auto text = t.Render({{"user", "Hello"}});
  ASSERT_TRUE(text.ok()) << text.status();
  EXPECT_EQ(*text,
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
            "assistant.<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
  // A given system message replaces the default; turns keep their order.
  text = t.Render({{"system", "Be brief."}, {"user", "Hi"}, {"assistant", "Hello!"}, {"user", "Bye"}});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
            "<|im_start|>assistant\nHello!<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n"
            "<|im_start|>assistant\n");
}

TEST(ChatTemplate, ChatMlWithoutDefaultSystem) {
  ChatTemplate t = ChatTemplate::FromGgufTemplate("{{'<|im_start|>' + message['role']}}");
  auto text = t.Render({{"user", "Hello"}});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, Llama3Exact) {
  ChatTemplate t = ChatTemplate::FromGgufTemplate("<|start_header_id|>");
  auto text = t.Render({{"system", "You help."}, {"user", " Hi there \n"}});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nYou help.<|eot_id|>"
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>"
            "<|start_header_id|>assistant<|end_header_id|>\n\n");
}

TEST(ChatTemplate, Llama2Exact) {
  ChatTemplate t = ChatTemplate::FromGgufTemplate("[INST]");
  auto text = t.Render({{"system", "Be kind."}, {"user", "Hi"}, {"assistant", "Hello"}, {"user", "Why?"}});
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text,
            "<s>[INST] <<SYS>>\nBe kind.\n<</SYS>>\n\nHi [/INST] Hello </s><s>[INST] Why? [/INST]");
}

TEST(ChatTemplate, ClearErrors) {
  ChatTemplate none = ChatTemplate::FromGgufTemplate("");
  auto r = none.Render({{"user", "x"}});
  EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.status().message().find("no chat template"), std::string::npos);
  ChatTemplate unknown = ChatTemplate::FromGgufTemplate("### Human:");
  r = unknown.Render({{"user", "x"}});
  EXPECT_NE(r.status().message().find("not one ellm knows"), std::string::npos);
  ChatTemplate chatml = ChatTemplate::FromGgufTemplate("<|im_start|>");
  EXPECT_NE(chatml.Render({}).status().message().find("no chat messages"), std::string::npos);
  EXPECT_NE(chatml.Render({{"robot", "x"}}).status().message().find("role 'robot'"), std::string::npos);
  EXPECT_NE(chatml.Render({{"user", "a"}, {"system", "b"}, {"user", "c"}}).status().message().find("first"),
            std::string::npos);
  EXPECT_NE(chatml.Render({{"user", "a"}, {"assistant", "b"}}).status().message().find("last"),
            std::string::npos);
}

}  // namespace
}  // namespace ellm::coord
