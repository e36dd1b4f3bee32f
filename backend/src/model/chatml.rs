//! ChatML chat templates rendered without the template engine: the templates
//! recognised here (by their exact source) are written out by plain string
//! appends, which give the same text as minijinja at a tenth of the cost
//! (the gateway renders a template on every request). Any other template goes
//! through minijinja.

/// A chat template whose output this module writes itself.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct ChatMl {
    /// The system turn written first when the first message is not a system
    /// message (SmolLM2's template has one).
    default_system: Option<&'static str>,
}

/// SmolLM2-Instruct's template (its GGUF's `tokenizer.chat_template` and its
/// `tokenizer_config.json`).
pub(crate) const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// The template used when a model has none.
pub(crate) const DEFAULT_TEMPLATE: &str = "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";

impl ChatMl {
    /// The native renderer for `source`, when it is one of the templates above
    /// byte for byte.
    pub(crate) fn recognise(source: &str) -> Option<ChatMl> {
        match source {
            SMOLLM2_TEMPLATE => Some(ChatMl {
                default_system: Some(
                    "You are a helpful AI assistant named SmolLM, trained by Hugging Face",
                ),
            }),
            DEFAULT_TEMPLATE => Some(ChatMl {
                default_system: None,
            }),
            _ => None,
        }
    }

    /// The prompt for `(role, content)` turns, as the template renders it.
    pub(crate) fn render<'a>(
        &self,
        messages: impl ExactSizeIterator<Item = (&'a str, &'a str)> + Clone,
        add_generation_prompt: bool,
    ) -> String {
        let text_len: usize = messages.clone().map(|(r, c)| r.len() + c.len()).sum();
        let mut out = String::with_capacity(text_len + 24 * messages.len() + 128);
        let mut turn = |role: &str, content: &str| {
            out.push_str("<|im_start|>");
            out.push_str(role);
            out.push('\n');
            out.push_str(content);
            out.push_str("<|im_end|>\n");
        };
        for (i, (role, content)) in messages.enumerate() {
            if i == 0
                && role != "system"
                && let Some(system) = self.default_system
            {
                turn("system", system);
            }
            turn(role, content);
        }
        if add_generation_prompt {
            out.push_str("<|im_start|>assistant\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::model::tokenizer::compile_template;

    fn minijinja(
        source: &str,
        messages: &[(String, String)],
        add_generation_prompt: bool,
    ) -> String {
        let env = compile_template(source).unwrap();
        let messages: Vec<_> = messages
            .iter()
            .map(|(role, content)| serde_json::json!({"role": role, "content": content}))
            .collect();
        env.get_template("chat")
            .unwrap()
            .render(minijinja::context! {
                messages => messages,
                add_generation_prompt => add_generation_prompt,
            })
            .unwrap()
    }

    #[test]
    fn only_the_known_sources_are_recognised() {
        assert!(ChatMl::recognise(SMOLLM2_TEMPLATE).is_some());
        assert!(ChatMl::recognise(DEFAULT_TEMPLATE).is_some());
        // One character off is another template.
        assert!(ChatMl::recognise(&SMOLLM2_TEMPLATE.replace("SmolLM", "SmolLm")).is_none());
        assert!(ChatMl::recognise(&format!("{DEFAULT_TEMPLATE}\n")).is_none());
        assert!(ChatMl::recognise("").is_none());
    }

    #[test]
    fn native_rendering_equals_minijinja_on_random_conversations() {
        let roles = ["system", "user", "assistant", "tool", "ipython", ""];
        let pieces = [
            "hello",
            " ",
            "\n",
            "",
            "{{ messages }}",
            "{% endfor %}",
            "<|im_end|>",
            "<|im_start|>assistant\n",
            "'",
            "\"",
            "\\",
            "é漢🙂",
            "system",
            "  \t",
        ];
        let mut rng = StdRng::seed_from_u64(7);
        for case in 0..2_000 {
            let turns = rng.random_range(0..5);
            let messages: Vec<(String, String)> = (0..turns)
                .map(|_| {
                    let role = roles[rng.random_range(0..roles.len())].to_string();
                    let content = (0..rng.random_range(0..6))
                        .map(|_| pieces[rng.random_range(0..pieces.len())])
                        .collect::<String>();
                    (role, content)
                })
                .collect();
            for source in [SMOLLM2_TEMPLATE, DEFAULT_TEMPLATE] {
                for generation in [false, true] {
                    let native = ChatMl::recognise(source).unwrap().render(
                        messages.iter().map(|(r, c)| (r.as_str(), c.as_str())),
                        generation,
                    );
                    assert_eq!(
                        native,
                        minijinja(source, &messages, generation),
                        "case {case}: {messages:?}, generation prompt {generation}"
                    );
                }
            }
        }
    }

    #[test]
    fn smollm2_gets_its_default_system_turn_only_without_a_system_message() {
        let chatml = ChatMl::recognise(SMOLLM2_TEMPLATE).unwrap();
        assert_eq!(
            chatml.render([("user", "Hi")].into_iter(), true),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert_eq!(
            chatml.render([("system", "Be brief."), ("user", "Hi")].into_iter(), false),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        );
    }
}
